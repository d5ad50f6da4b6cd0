__version__ = "0.1.0"
"""hvrep's version (``setup.py`` reads it from here)."""
