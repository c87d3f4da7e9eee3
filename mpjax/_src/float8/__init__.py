"""FP8: policies, scaling recipes and the FP8 dot."""
