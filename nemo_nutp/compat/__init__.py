"""Platform compatibility shims (see :mod:`nemo_nutp.compat.cpu`)."""

from nemo_nutp.compat.cpu import apply_cpu_patches, cpu_attention_mask, is_patched

__all__ = ["apply_cpu_patches", "cpu_attention_mask", "is_patched"]
