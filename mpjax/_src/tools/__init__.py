"""The audit and precision tools: what ran in which precision, where precision is lost,
and the compiled program's cost."""
