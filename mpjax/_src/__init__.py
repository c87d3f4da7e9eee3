"""mpjax internals; import from `mpjax` instead."""
