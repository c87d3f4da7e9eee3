"""The optimizers' state: half params without float32 masters, 8-bit moments."""
