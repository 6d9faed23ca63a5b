"""One attention layer's low-bit KV state for the transformers cache: pure PyTorch, no transformers import.

Tokens arrive as [batch, kv_heads, new, head_dim] (transformers' layout). The newest ones stay in the model
dtype (the *full-precision window*); once the window holds `window` = max(residual_length, page_size) tokens,
all its full pages are quantized through `moekv.kv.quantize` (keys per channel over each page, values per
token) and fewer than `page_size` tokens stay behind — transformers' QuantizedCache flushes its residual
window the same way, so with equal residual_length both hold the same number of full-precision tokens.

The state of a layer:

    chunks        list of QuantizedChunk: tokens [start, start + length) of every sequence, low-bit,
                  one moekv.kv.QuantizedKV per sequence (statistics never mix sequences)
    quantized     tokens held in chunks (a multiple of page_size): positions [0, quantized)
    length        tokens held in all: positions [quantized, length) are the full-precision window
    committed     positions [0, committed) are in their final form (see below); committed <= quantized

Two ways to hand transformers the whole cache each step (`dequantized_copy`):

- True (default): a growing buffer [B, H, capacity, D] in the model dtype holds the dequantized copy of the
  quantized part followed by the full-precision window; a step writes its new rows and returns a view of the
  first `length` rows. Only newly quantized pages are ever dequantized. The buffer is a compute cache: it
  costs as much memory as a full-precision cache (see docs/transformers-cache.md).
- False: only the window is kept in the model dtype; every step dequantizes all chunks and concatenates
  (transformers' QuantizedCache does the same): memory is the low-bit state plus the window.

Pages quantized during a step are used by *later* steps only: the step that fills a page attends to its own
new tokens in full precision (as moekv's engine does). Their full-precision rows are kept until the next
`append` (the *commit*), so `crop` right after a step, e.g. by assisted decoding, restores the cache exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moekv.integrations.settings import LowBitCacheSettings


@dataclass
class QuantizedChunk:
    """Tokens [start, start + length) of every sequence in the batch, in low-bit form."""

    start: int
    length: int
    keys: list                       # one moekv.kv.QuantizedKV [length, H, D] per sequence
    values: list
    committed: bool = False
    pending: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # dequantized_copy=True, before the commit: the dequantized rows [B, H, length, D] to write into the buffer

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.keys) + sum(q.nbytes for q in self.values)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both halves as [B, H, length, D] in the original dtype."""
        keys = torch.stack([q.dequantize() for q in self.keys]).transpose(1, 2)      # [B, H, length, D]
        values = torch.stack([q.dequantize() for q in self.values]).transpose(1, 2)
        return keys, values

    def select(self, rows: list[int]) -> "QuantizedChunk":
        """The same chunk for the sequences `rows` (a committed chunk: no pending rows)."""
        return QuantizedChunk(self.start, self.length, [self.keys[r] for r in rows], [self.values[r] for r in rows],
                              committed=True)


class LowBitKVStore:
    """The low-bit KV state of one layer. Validated settings in; tensors [B, H, T, D] in and out."""

    def __init__(self, settings: LowBitCacheSettings):
        self.settings = settings
        self.chunks: list[QuantizedChunk] = []
        self.length = 0
        self.batch_size = 0
        self.num_heads = 0
        self.head_dim = 0
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        # dequantized_copy=True: rows [0, length) of the buffers are the cache, see the module docstring
        self._buffer_keys: torch.Tensor | None = None       # [B, H, capacity, D]
        self._buffer_values: torch.Tensor | None = None
        # dequantized_copy=False: the full-precision rows [window_start, length)
        self._window_keys: torch.Tensor | None = None       # [B, H, length - window_start, D]
        self._window_values: torch.Tensor | None = None
        self._window_start = 0

    # ------------------------------------------------------------------ shape and accounting

    @property
    def initialized(self) -> bool:
        return self.dtype is not None

    @property
    def quantized(self) -> int:
        return self.chunks[-1].end if self.chunks else 0

    @property
    def window_length(self) -> int:
        """Tokens held in full precision (the newest ones)."""
        return self.length - self.quantized

    @property
    def num_values(self) -> int:
        """Keys plus values held, counted as scalars (padding positions included)."""
        return 2 * self.batch_size * self.num_heads * self.length * self.head_dim

    @property
    def lowbit_nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)

    @property
    def window_nbytes(self) -> int:
        if not self.initialized:
            return 0
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.batch_size * self.num_heads * self.window_length * self.head_dim * element

    @property
    def nbytes(self) -> int:
        """The stored state: low-bit chunks (codes, scales, zero points, outliers) + the full-precision window."""
        return self.lowbit_nbytes + self.window_nbytes

    @property
    def working_nbytes(self) -> int:
        """The compute cache on top of `nbytes`: the dequantized buffer (dequantized_copy=True), else 0."""
        if self._buffer_keys is None:
            return 0
        buffers = self._buffer_keys.nbytes + self._buffer_values.nbytes
        pending = sum(c.pending[0].nbytes + c.pending[1].nbytes for c in self.chunks if c.pending is not None)
        return buffers + pending - self.window_nbytes

    # ------------------------------------------------------------------ the step

    def initialize(self, keys: torch.Tensor) -> None:
        """Take batch size, heads, head_dim, dtype and device from the first keys [B, H, T, D]."""
        self.batch_size, self.num_heads, _, self.head_dim = keys.shape
        self.dtype, self.device = keys.dtype, keys.device
        if self.settings.dequantized_copy:
            self._buffer_keys = keys.new_empty(self.batch_size, self.num_heads, 0, self.head_dim)
            self._buffer_values = keys.new_empty(self.batch_size, self.num_heads, 0, self.head_dim)
        else:
            self._window_keys = keys.new_empty(self.batch_size, self.num_heads, 0, self.head_dim)
            self._window_values = keys.new_empty(self.batch_size, self.num_heads, 0, self.head_dim)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new rows [B, H, n, D]; return the whole cache [B, H, length, D] for this step's attention
        (earlier pages dequantized, the window and the new rows in full precision)."""
        if not self.initialized:
            self.initialize(keys)
        self.commit()
        new = keys.shape[-2]
        if self.settings.dequantized_copy:
            self._reserve(self.length + new)
            self._buffer_keys[:, :, self.length:self.length + new] = keys
            self._buffer_values[:, :, self.length:self.length + new] = values
            self.length += new
            all_keys = self._buffer_keys[:, :, :self.length]
            all_values = self._buffer_values[:, :, :self.length]
        else:
            self._window_keys = torch.cat([self._window_keys, keys], dim=-2)
            self._window_values = torch.cat([self._window_values, values], dim=-2)
            self.length += new
            prefix = [chunk.dequantize() for chunk in self.chunks]
            all_keys = torch.cat([k for k, _ in prefix] + [self._window_keys], dim=-2)
            all_values = torch.cat([v for _, v in prefix] + [self._window_values], dim=-2)
        self._quantize_full_pages()
        return all_keys, all_values

    def _window_rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision rows [start, end) of the window, [B, H, end - start, D]."""
        if self.settings.dequantized_copy:
            return self._buffer_keys[:, :, start:end], self._buffer_values[:, :, start:end]
        offset = self._window_start
        return (self._window_keys[:, :, start - offset:end - offset],
                self._window_values[:, :, start - offset:end - offset])

    def _quantize_full_pages(self) -> None:
        page, window = self.settings.page_size, self.settings.window
        if self.window_length < window:
            return
        pages = self.window_length // page                 # every full page of the window
        start, end = self.quantized, self.quantized + pages * page
        keys, values = self._window_rows(start, end)
        quantized_keys = [self._quantize(keys[b].transpose(0, 1), "key") for b in range(self.batch_size)]
        quantized_values = [self._quantize(values[b].transpose(0, 1), "value") for b in range(self.batch_size)]
        chunk = QuantizedChunk(start, end - start, quantized_keys, quantized_values)
        if self.settings.dequantized_copy:
            chunk.pending = chunk.dequantize()
        self.chunks.append(chunk)

    def _quantize(self, x: torch.Tensor, kind: str):
        """x [tokens, H, D] -> moekv.kv.QuantizedKV."""
        from moekv import kv

        s = self.settings
        fraction = s.outlier_fraction if kind == "key" else s.resolved_value_outlier_fraction
        group = s.resolved_value_group_size(self.head_dim) if kind == "value" else None
        try:
            return kv.quantize(x, kind=kind, bits=s.bits, outlier_fraction=fraction, page_size=s.page_size,
                               outlier_tau=s.outlier_tau, group_size=group,
                               clip_steps=s.key_clip_steps if kind == "key" else s.resolved_value_clip_steps,
                               clip_refine=s.key_clip_refine if kind == "key" else s.value_clip_refine,
                               outlier_select=s.resolved_outlier_select)
        except ValueError as error:
            raise ValueError(f"LowBitCache could not quantize {kind}s: {error}") from error

    def commit(self) -> None:
        """Put chunks quantized by the previous step in their final form (dequantized rows in the buffer,
        or full-precision rows dropped from the window)."""
        for chunk in self.chunks:
            if chunk.committed:
                continue
            if self.settings.dequantized_copy:
                self._buffer_keys[:, :, chunk.start:chunk.end] = chunk.pending[0]
                self._buffer_values[:, :, chunk.start:chunk.end] = chunk.pending[1]
                chunk.pending = None
            else:
                drop = chunk.end - self._window_start
                self._window_keys = self._window_keys[:, :, drop:]
                self._window_values = self._window_values[:, :, drop:]
                self._window_start = chunk.end
            chunk.committed = True

    def _reserve(self, rows: int) -> None:
        capacity = self._buffer_keys.shape[-2]
        if rows <= capacity:
            return
        grown = max(rows, capacity + capacity // 2, 2 * self.settings.page_size)
        for name in ("_buffer_keys", "_buffer_values"):
            old = getattr(self, name)
            new = old.new_empty(self.batch_size, self.num_heads, grown, self.head_dim)
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)

    # ------------------------------------------------------------------ edits

    def crop(self, new_length: int) -> None:
        """Keep the first `new_length` tokens. Exact when the dropped tokens came in after the last commit
        (e.g. rejected draft tokens); kept tokens of an older chunk that is cut return to the window as
        their dequantized values."""
        new_length = max(0, new_length)
        if not self.initialized or new_length >= self.length:
            return
        dropped = []
        while self.chunks and self.chunks[-1].end > new_length:
            dropped.append(self.chunks.pop())
        # dequantized_copy=True: the buffer holds every row (dequantized when committed, else full precision)
        if not self.settings.dequantized_copy:
            restored = [c.dequantize() for c in reversed(dropped) if c.committed]          # oldest first
            if restored:              # then every kept chunk is committed and the window starts where they end
                self._window_keys = torch.cat([k for k, _ in restored] + [self._window_keys], dim=-2)
                self._window_values = torch.cat([v for _, v in restored] + [self._window_values], dim=-2)
                self._window_start = self.quantized
            keep = new_length - self._window_start
            self._window_keys = self._window_keys[:, :, :keep]
            self._window_values = self._window_values[:, :, :keep]
        self.length = new_length

    def select_batch(self, rows: list[int]) -> None:
        """Keep (or reorder, or repeat) sequences: the new batch row i is the old row rows[i]."""
        if not self.initialized:
            return
        self.commit()
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.settings.dequantized_copy:
            self._buffer_keys = self._buffer_keys[:, :, :self.length].index_select(0, index)
            self._buffer_values = self._buffer_values[:, :, :self.length].index_select(0, index)
        else:
            self._window_keys = self._window_keys.index_select(0, index)
            self._window_values = self._window_values.index_select(0, index)
        self.chunks = [chunk.select(rows) for chunk in self.chunks]
        self.batch_size = len(rows)

    def reset(self) -> None:
        self.__init__(self.settings)
