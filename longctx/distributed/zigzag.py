"""Which tokens of a sequence each context-parallel rank holds, and moving between that and the whole.

Two layouts of a sequence of S tokens over `cp` ranks:

  zigzag      the sequence is cut into 2*cp equal chunks and rank r holds chunks r and 2cp-1-r,
              in that order (cp=2, S=8: rank 0 holds t0 t1 t6 t7, rank 1 holds t2..t5). Causal
              attention over the sequence then costs every rank the same: each has one early and
              one late chunk. This is the layout between layers.
  contiguous  rank r holds tokens [r*S/cp, (r+1)*S/cp): the layout a chunkwise state pass wants
              when it runs on its own (fla's context parallel takes this one).

S must be a multiple of 2*cp (zigzag) or cp (contiguous); otherwise `check_seq_len` raises a
ConfigError naming the lengths that work. Padding the sequence instead would be exact for the
causal mixers (trailing pad tokens influence nothing before them) but not for what counts tokens:
the MoE's balance statistics, the loss and indexer-KL means. The packer can fill a sequence to any
length, so a length rule is the simpler contract.

Every function here works on dimension `dim` (default 1, the sequence dimension of [B, S, ...]).
"""

from __future__ import annotations

import functools

import torch

from . import comm

LAYOUTS = ("zigzag", "contiguous")


def _pieces(cp: int, layout: str) -> int:
    if layout not in LAYOUTS:
        from ..errors import ConfigError, did_you_mean

        raise ConfigError(f"the context-parallel layout must be one of {', '.join(LAYOUTS)} (got {layout!r})"
                          f"{did_you_mean(layout, LAYOUTS)}.")
    return 2 * cp if layout == "zigzag" else cp


def check_seq_len(S: int, cp: int, layout: str = "zigzag") -> None:
    """Raise a ConfigError unless S splits evenly into this layout's pieces."""
    n = _pieces(cp, layout)
    if cp < 1 or S < n or S % n:
        from ..errors import ConfigError

        lo, hi = S // n * n, (S // n + 1) * n
        fix = f"{hi}" if lo == 0 else f"{lo} or {hi}"
        raise ConfigError(f"sequence length {S} cannot be split over parallel.cp = {cp} ranks ({layout} sharding cuts it "
                          f"into {n} equal pieces); make the stage's seq_len a multiple of {n}, e.g. {fix}.")


@functools.lru_cache(maxsize=256)
def segments(S: int, cp: int, rank: int, layout: str = "zigzag") -> tuple[tuple[int, int], ...]:
    """The [start, end) spans of the sequence rank `rank` holds, in the order it holds them."""
    check_seq_len(S, cp, layout)
    if layout == "contiguous":
        n = S // cp
        return ((rank * n, (rank + 1) * n),)
    c = S // (2 * cp)
    late = 2 * cp - 1 - rank
    return ((rank * c, (rank + 1) * c), (late * c, (late + 1) * c))


def positions(S: int, cp: int, rank: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """int64 [S / cp]: the sequence position of each of this rank's tokens, in its order."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in segments(S, cp, rank, layout)])


@functools.lru_cache(maxsize=64)
def _slot_positions(S: int, cp: int, layout: str) -> torch.Tensor:
    """int64 [S]: the sequence position of slot (rank j, local i) at j * S/cp + i."""
    return torch.cat([positions(S, cp, j, layout) for j in range(cp)])


@functools.lru_cache(maxsize=64)
def _sequence_order(S: int, cp: int, layout: str) -> torch.Tensor:
    """int64 [S]: for each sequence position, its slot (the inverse of `_slot_positions`)."""
    return torch.argsort(_slot_positions(S, cp, layout))


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """This rank's tokens of the whole sequence x (a local copy, no communication)."""
    S = x.shape[dim]
    return x.index_select(dim, positions(S, cp, rank, layout, device=x.device))


def gathered_to_sequence(g: torch.Tensor, S: int, layout: str = "zigzag") -> torch.Tensor:
    """[cp, B, S/cp, ...] (row j = rank j's tokens) -> [B, S, ...] in sequence order."""
    cp, B, T = g.shape[:3]
    flat = g.transpose(0, 1).reshape(B, cp * T, *g.shape[3:])
    return flat.index_select(1, _sequence_order(S, cp, layout).to(g.device))


def sequence_to_owners(x: torch.Tensor, cp: int, layout: str = "zigzag") -> torch.Tensor:
    """[B, S, ...] in sequence order -> [cp, B, S/cp, ...], row j holding rank j's tokens (what an
    all-to-all then delivers to their owners)."""
    B, S = x.shape[:2]
    rows = x.index_select(1, _slot_positions(S, cp, layout).to(x.device))
    return rows.view(B, cp, S // cp, *x.shape[2:]).transpose(0, 1)


def unshard(x: torch.Tensor, group, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """Every rank's tokens gathered back into the whole sequence, on every rank; differentiable.

    The gradient of a token sums what every rank's loss sends it and lands on its owner, so each
    rank's loss counts once (a loss computed identically on every rank counts cp times)."""
    cp = comm.group_size(group)
    x = x.movedim(dim, 1)
    full = gathered_to_sequence(comm.all_gather(x, group), cp * x.shape[1], layout)
    return full.movedim(1, dim)
