"""A template heterollm backend: platform "template", kernels delegating to plain torch ops.

Keep this module import-light: heterollm reads `__heterollm_api__` (the contract range this
backend implements) before it imports any entry point module or torch.
"""
__heterollm_api__ = ">=1.0,<2"
__version__ = "0.1.0"
