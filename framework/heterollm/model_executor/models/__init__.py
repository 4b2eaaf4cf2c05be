"""The core's model implementations, one file per family, registered under the model family "core"
(the fallback of every architecture) through the core's own backend descriptor."""
from heterollm.interfaces.backend import Backend

CORE_BACKEND = Backend(
    name="core", api_version=">=2.0,<3",
    kv_connectors={"host": "heterollm.kv_cache.host_tier:HostMemoryConnector",
                   "mooncake_store": "heterollm.kv_cache.store_tier:MooncakeStoreConnector",
                   "mooncake_transfer": "heterollm.kv_cache.pd:MooncakeTransferConnector"},
    models={
        "LlamaForCausalLM": "heterollm.model_executor.models.llama:LlamaForCausalLM",
        "MistralForCausalLM": "heterollm.model_executor.models.llama:LlamaForCausalLM",
        "Qwen2ForCausalLM": "heterollm.model_executor.models.llama:Qwen2ForCausalLM",
        "Qwen3ForCausalLM": "heterollm.model_executor.models.llama:Qwen3ForCausalLM",
        "Phi3ForCausalLM": "heterollm.model_executor.models.phi3:Phi3ForCausalLM",
        "GlmForCausalLM": "heterollm.model_executor.models.glm4:GlmForCausalLM",
        "Glm4ForCausalLM": "heterollm.model_executor.models.glm4:Glm4ForCausalLM",
        "Gemma2ForCausalLM": "heterollm.model_executor.models.gemma3:Gemma2ForCausalLM",
        "Gemma3ForCausalLM": "heterollm.model_executor.models.gemma3:Gemma3ForCausalLM",
        "Qwen2MoeForCausalLM": "heterollm.model_executor.models.qwen2_moe:Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM": "heterollm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM",
        "MixtralForCausalLM": "heterollm.model_executor.models.mixtral:MixtralForCausalLM",
        "DeepseekV2ForCausalLM": "heterollm.model_executor.models.deepseek_v2:DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM": "heterollm.model_executor.models.deepseek_v2:DeepseekV3ForCausalLM",
        "LlamaForSequenceClassification": "heterollm.model_executor.models.llama:LlamaForSequenceClassification",
        "MistralForSequenceClassification": "heterollm.model_executor.models.llama:LlamaForSequenceClassification",
        "Qwen2ForSequenceClassification": "heterollm.model_executor.models.llama:Qwen2ForSequenceClassification",
        "Qwen3ForSequenceClassification": "heterollm.model_executor.models.llama:Qwen3ForSequenceClassification",
        "Qwen2VLForConditionalGeneration": "heterollm.model_executor.models.qwen2_vl:Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration":
            "heterollm.model_executor.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
    },
)
