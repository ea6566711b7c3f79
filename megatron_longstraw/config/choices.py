"""The named choices settings take that lower wings also read: the prompt state's gradient
(`PromptGrad`, read by state/attention_pass.py and every mixer) and the storage formats of a
page kind (`PAGE_FORMATS`, implemented by state/pages.py). They live here, at the bottom of the
import order, so the settings import nothing above them."""

from __future__ import annotations

import enum


class PromptGrad(enum.StrEnum):
    """The prompt state's gradient (`ReplaySettings.prompt_grad`, docs/design.md section 7). A
    `StrEnum`: YAML, flags, JSON and f-strings keep the strings "detached" / "exact"."""

    DETACHED = "detached"
    """d loss / d theta at fixed prompt state (the paper's): prompt pages are constants."""
    EXACT = "exact"
    """Standard GRPO's gradient: replay sends d loss / d state to the pages' cotangent buffers,
    then the prompt's backward (pass mode `prompt_backward`, prompt_backward.py) runs the
    prompt's layers in reverse."""


PAGE_FORMATS = ("model", "fp8")
"""Storage formats of a page kind (state/pages.py's module docstring): the storage dtype, or FP8
rows (e4m3 + one fp32 scale per row)."""
