"""The bottom layer: plain records every package may import; imports nothing of moekv above it.

request.py           Request, RequestStatus, RequestOutput (a request's state through the engine)
sampling_params.py   SamplingParams (public as moekv.SamplingParams / moekv.sampling.SamplingParams)
attention_metadata.py AttentionMetadata (where each sequence of a step stands; built once per step)
lowbit_layout.py     QuantSpec, PackedPages: the low-bit page layout
lowbit_pack.py       bit-plane packing of low-bit codes

Only moekv.config and moekv.errors (leaf modules) may be imported from here.
"""
