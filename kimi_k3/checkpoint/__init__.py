"""Checkpoints on disk: reading safetensors files (``files``), recorded checksums
(``checksums``), the three layouts a checkpoint comes in (``layouts``), the expert pack
(``expert_pack``) and ``load_model`` (``loader``), which builds the model from any of them
with resident or streamed experts.
"""
