"""Loss scaling: the loss scales as pytrees, the optax transformation and gradient helpers."""
