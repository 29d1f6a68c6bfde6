"""isotrain: five PyTorch training patterns as tested library pieces, plus a reference trainer."""

__version__ = "0.1.0"
__all__ = ["__version__"]
