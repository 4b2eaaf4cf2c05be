"""Example third-party attention family: a component-only backend (no platform) giving the family
"example" an attention kernel for the CPU platform. Keep this module light: the core reads
`BACKEND.api_version` before it imports `attention` (and torch)."""
from heterollm.interfaces.backend import Backend

BACKEND = Backend(
    name="example",
    api_version=">=2.0,<3",
    platforms=("cpu",),  # the platforms its components run on (it brings no platform of its own)
    components={"attention": "heterollm_example_attention.attention:ExampleAttention"},
)
