"""The template's own launch flags. They join heterollm's config when this wheel is installed
(`config.template.template_fast_path`, `--template_fast_path` on the command line, in JSON config
files, in `heterollm config` and docs/flags.md), and are refused when another platform is selected."""
from heterollm.config.base import FlagGroup, flag


class TemplateFlags(FlagGroup):
    """template backend flags (heterollm-backend-template)."""

    template_fast_path: bool = flag(False, "Run the template's MLP through its fused op "
                                           "(template.fused_mlp) instead of the core's silu_and_mul.")
