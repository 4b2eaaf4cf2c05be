"""heterollm's CUDA backend. Import-light: heterollm reads `__heterollm_api__` before importing
any entry point module (or torch)."""
__heterollm_api__ = ">=1.0,<2"
__version__ = "0.1.0"
