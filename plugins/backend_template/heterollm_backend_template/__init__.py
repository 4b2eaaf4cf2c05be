"""A template heterollm backend: platform "template", kernels delegating to plain torch ops, one flag
(`--template_fast_path`), one op of its own and one model override, all declared here.

Keep this module import-light (no torch, no vendor library): heterollm reads `BACKEND.api_version`
before it imports any class named below.
"""
from heterollm.interfaces.backend import Backend
from heterollm_backend_template.flags import TemplateFlags

__version__ = "0.1.0"

BACKEND = Backend(
    name="template",  # what users pass to --device, and the family --extension_impl selects
    api_version=">=2.0,<3",  # the contract range this backend implements
    platform="heterollm_backend_template.platform:TemplatePlatform",
    components={
        "attention": "heterollm_backend_template.attention:TemplateAttention",
        "graph_runners": "heterollm_backend_template.graph_runner:TemplateGraphRunner",
        "communicators": "heterollm_backend_template.communicator:TemplateCommunicator",
        "executors": "heterollm.model_executor.executor:InProcessExecutor",  # the core's, as is
    },
    models={"LlamaForCausalLM": "heterollm_backend_template.models:TemplateLlamaForCausalLM"},
    flags={"template": TemplateFlags},
    unsupported={
        "enable_graph": "the template runs every step eagerly (it has no graph API)",
        "kv_cache_dtype": "the template stores K/V in the model dtype (no int8 KV cache)",
    },
    register_ops="heterollm_backend_template.ops:register_ops",
)
