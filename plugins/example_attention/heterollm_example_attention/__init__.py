"""Example third-party attention family. Keep this module light: the core reads
`__heterollm_api__` from it before importing `attention` (and torch)."""
__heterollm_api__ = ">=1.0,<2"
