"""heterollm's CPU backend, the reference every other backend is tested against.

This module stays import-light: the registry reads `__heterollm_api__` before any entry point's
module (and torch) is imported.
"""
__heterollm_api__ = ">=1.0,<2"
__version__ = "0.1.0"
