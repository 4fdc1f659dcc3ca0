"""lorakit: the toolkit's library. Importing it loads nothing else: each layer is imported by name
(lorakit.records stays torch-free)."""

__version__ = "0.9.0"
