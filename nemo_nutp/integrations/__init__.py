"""Integrations with the rest of the NeMo / megatron-core ecosystem (GPU images)."""
