"""Fragments of the flat parameter vector, and who owns which slice of each.

Read end to end, an optimizer's parameters form one flat vector of ``N``
elements. DiLoCo cuts it into ``P`` contiguous *fragments* of ``N // P`` or
``N // P + 1`` elements (tensors are split at the seams), and each fragment
into ``W`` contiguous *slices*, one per rank of the outer group: the slice's
owner alone keeps that part of the anchor and of the outer optimizer's
state. Both cuts are :func:`zerofn.zero.planning.partition.flat_partition`'s.

The helpers copy a fragment's elements out of the parameters (into one
``float32`` vector, the form every sync works on) and back.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from zerofn.zero.planning.partition import Piece, flat_partition

__all__ = ["Fragment", "FragmentPlan", "plan_fragments", "read_fragment", "write_fragment"]


@attrs.frozen
class Fragment:
    """One fragment: where it sits, and its owners' slices.

    Attributes:
        index: its position among the fragments.
        start: its first element in the flat parameter vector.
        pieces: the parts of parameters it covers, in order (a
            :class:`~zerofn.zero.planning.partition.Piece` names a parameter by its
            position in the optimizer's order).
        bounds: ``W + 1`` offsets into the fragment: rank ``r`` owns
            ``[bounds[r], bounds[r + 1])``.
    """

    index: int
    start: int
    pieces: tuple[Piece, ...]
    bounds: tuple[int, ...]

    @property
    def numel(self) -> int:
        """The fragment's element count."""
        return self.bounds[-1]

    @property
    def lengths(self) -> tuple[int, ...]:
        """Each rank's slice length, in rank order."""
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False))

    def owned(self, rank: int) -> slice:
        """Rank ``rank``'s slice, as indices into the fragment's elements."""
        return slice(self.bounds[rank], self.bounds[rank + 1])

    def slices(self, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of ``values`` (the fragment's elements), one per owner, in rank order."""
        return tuple(values[self.owned(rank)] for rank in range(len(self.bounds) - 1))

    def check_fits(self, rank: int, own: tuple[str, torch.Tensor], **whole: torch.Tensor) -> None:
        """Check a sync's tensors: each of ``whole`` the fragment's elements
        in ``float32``, and ``own`` (its name, the tensor) rank ``rank``'s slice.

        Raises:
            ValueError: the first tensor that does not fit, named.
        """
        for name, tensor in whole.items():
            if tensor.shape != (self.numel,) or tensor.dtype != torch.float32:
                raise ValueError(
                    f"fragment {self.index}: {name} must be float32 of shape ({self.numel},), "
                    f"got {tensor.dtype} {tuple(tensor.shape)}"
                )
        name, tensor = own
        if tensor.shape != (self.lengths[rank],):
            raise ValueError(
                f"fragment {self.index}: rank {rank}'s {name} slice has "
                f"{self.lengths[rank]} elements, got shape {tuple(tensor.shape)}"
            )


@attrs.frozen
class FragmentPlan:
    """How the parameters are cut for one outer group.

    Attributes:
        sizes: every parameter's element count, in the optimizer's order.
        world_size: ranks of the outer group.
        fragments: the fragments, in order; they tile the flat vector.
    """

    sizes: tuple[int, ...]
    world_size: int
    fragments: tuple[Fragment, ...]

    @property
    def numel(self) -> int:
        """Elements in all parameters."""
        return sum(self.sizes)

    def owned_numel(self, rank: int) -> int:
        """Elements whose outer state ``rank`` keeps, over all fragments."""
        return sum(f.lengths[rank] for f in self.fragments)


def plan_fragments(sizes: Sequence[int], fragments: int, world_size: int) -> FragmentPlan:
    """Cut ``sizes``' flat vector into ``fragments`` fragments and each into
    ``world_size`` owners' slices.

    Args:
        sizes: every parameter's element count, in the optimizer's order.
        fragments: how many fragments.
        world_size: ranks of the outer group.

    Returns:
        The :class:`FragmentPlan`.

    Raises:
        ValueError: no elements at all, more fragments than elements (a
            fragment would be empty), a negative size, or a non-positive
            ``fragments`` or ``world_size``.
    """
    total = sum(int(n) for n in sizes)
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"fragments must be a positive int, got {fragments!r}")
    if total == 0:
        raise ValueError("DiLoCo needs parameters with at least one element; got none")
    if fragments > total:
        raise ValueError(
            f"cannot cut {total} parameter elements into {fragments} fragments (one would be "
            f"empty); use fragments <= {total}"
        )
    cut = flat_partition([list(sizes)], fragments)
    out = []
    for index in range(fragments):
        start, stop = cut.bounds[index], cut.bounds[index + 1]
        owners = flat_partition([[stop - start]], world_size)
        out.append(Fragment(index, start, cut.pieces_of(index), owners.bounds))
    return FragmentPlan(tuple(int(n) for n in sizes), world_size, tuple(out))


def _piece_view(param: torch.Tensor, piece: Piece) -> torch.Tensor:
    return param.detach().view(-1)[piece.start : piece.stop]


def read_fragment(
    fragment: Fragment, params: Sequence[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The fragment's elements of ``params``, as one ``float32`` vector.

    Args:
        fragment: which elements.
        params: every parameter, in the optimizer's order (only read).
        out: a ``float32`` vector of ``fragment.numel`` elements to write
            into, or ``None`` for a new one.

    Returns:
        The vector (``out`` when given).
    """
    device = params[fragment.pieces[0].param].device
    if out is None:
        out = torch.empty(fragment.numel, dtype=torch.float32, device=device)
    offset = 0
    for piece in fragment.pieces:
        out[offset : offset + piece.numel].copy_(_piece_view(params[piece.param], piece))
        offset += piece.numel
    return out


def write_fragment(
    fragment: Fragment, params: Sequence[torch.Tensor], values: torch.Tensor
) -> None:
    """Copy ``values`` (the fragment's elements) into ``params``, each element
    rounded once to its parameter's dtype; ``params`` are written in place."""
    offset = 0
    with torch.no_grad():
        for piece in fragment.pieces:
            _piece_view(params[piece.param], piece).copy_(values[offset : offset + piece.numel])
            offset += piece.numel
