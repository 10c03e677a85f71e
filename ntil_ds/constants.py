"""Values that data/ and loss/ must agree on without importing each other."""

# The target of a position that is not trained on (PyTorch's cross-entropy default, Hugging Face's too).
IGNORE_INDEX = -100
