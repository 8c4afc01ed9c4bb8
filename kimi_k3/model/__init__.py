"""The model layer: the Kimi K3 network as ``mlx.nn`` modules, importing nothing of the
package above it (checkpoint reading, streaming, serving).

Modules: ``config`` (``ModelArgs`` from ``config.json``), ``kda`` (Kimi Delta Attention and
its recurrence), ``attention`` (the KDA and gated MLA mixers), ``attn_res`` (Attention
Residuals), ``experts`` (the expert-store interface, the resident store, expert tensor
names), ``routing`` (the router's choice and expert trimming), ``moe`` (SiTU-GLU MLPs and
Stable LatentMoE), ``parallel`` (pipeline, tensor and expert parallel over an
``mx.distributed`` group) and ``model`` (the decoder and ``Model``, mlx-lm's protocol).
"""
