"""Draft trees: their shape, their attention mask, building them, verifying them.

Pure PyTorch, no vLLM import. The tree drafters (EAGLE heads, MTP, the draft model, MTAD's
beams) build trees with :func:`tree_from_beams` or :func:`tree_from_paths`; the tree engine
feeds a :class:`TreeBatch` to the target in one forward pass with
:func:`tree_attention_mask` and verifies it with :func:`verify_tree`.

The batch: :class:`TreeBatch`
-----------------------------
``B`` requests' trees, each flattened breadth-first and laid out ragged like
:class:`~vllm_specx.algorithms.verify.VerifyBatch`: request ``b`` owns the flat nodes
``[cu[b] - n_b, cu[b])`` (``cu_num_nodes`` is the inclusive cumulative sum, ``n_b`` may
be 0). Node ``i`` of a request (``0 <= i < n_b``) has a draft token and a parent: the
parent's index within the same request, or ``-1`` when the node is a child of the ROOT,
the request's last accepted token. Parents come before their children (``parent < i``),
so a node's depth (``1`` for a child of the root) is its position offset: the target
sees node ``i`` at position ``ctx + depth(i) - 1``.

The target's distributions, ``node_probs`` ``[T + B, V]``: request ``b`` has ``n_b + 1``
rows starting at flat row ``cu[b] - n_b + b``; row 0 is the target's (warped)
distribution after the root, row ``1 + i`` the distribution after node ``i``'s path.
That is vLLM's per-request ``[target rows..., bonus row]`` when the tree's tokens are
fed in BFS order after the root.

Verification rules (:func:`verify_tree`)
----------------------------------------
A walk from the root: at the current node look at its children in node order.

* greedy requests (``is_greedy``), under every rule: move to the first child whose token
  is ``target_argmax`` at the current node; when none is, stop and emit that argmax
  (at a leaf: the leaf row's argmax). ``target_argmax`` ``[T + B]`` is the argmax of the
  logits, passed in, as ``VerifyBatch`` takes it (default: the first maximum of the rows).
* ``"sampled"``: children drawn i.i.d. from the drafter's ``q`` (one row per parent,
  given per child as ``draft_probs[T, V]``), tried in draw order (SpecInfer's multi-step
  speculative sampling, Miao et al., "SpecInfer: Accelerating Large Language Model
  Serving with Tree-based Speculative Inference and Verification"). ``p' = p_current``;
  child ``x`` is accepted iff ``u < p'(x) / q(x)``; on rejection
  ``p' = norm(max(p' - q, 0))`` and the next child is tried; all rejected: the extra
  token is drawn from ``p'``. Lossless only for i.i.d. children in draw order.
* ``"deterministic"``: children chosen without the verifier's randomness (the drafter's
  top-k, EAGLE-2 style: Li et al., "EAGLE-2: Faster Inference of Language Models with
  Dynamic Draft Trees"; also without-replacement samples): child ``x`` is accepted iff
  ``u < p'(x)``; on rejection ``p'(x) = 0`` and ``p'`` is renormalised; all rejected:
  the extra token is drawn from ``p'``. A duplicate sibling token is therefore never
  accepted (its ``p'`` is already 0). One child per node is the one-hot rule of the
  chain sampler. Lossless for any children independent of the verifier's randomness.
* ``"mtad"`` (Qin et al., "Optimized Multi-Token Joint Decoding with Auxiliary Model
  for LLM Inference"): ``S(n) = sum over n's path of log p - log q`` (``p`` of each
  path token from its parent's row, ``q = draft_token_probs``); accept the DEEPEST node
  with ``S(n) > log(tau)`` (ties: the higher joint draft probability, then the lower
  node index), the root when none passes, and draw the extra token from ``p`` at that
  node (no residual). Every beam of MTAD's search is a root-to-leaf path of one tree.

Evaluated in float32 with the chain sampler's operations, so a chain (every node's
parent the previous node) is decided bit for bit as
:func:`vllm_specx.algorithms.verify.verify` decides it. ``"sampled"``: siblings share one
``q`` row (their parent's), and after ``j`` rejections at a node
``p' = max(p - c q, 0) / M`` (``c = 0, M = 1`` at first; a rejection sets ``c <- c + M``,
``M <- sum(max(p - c q, 0))``: the same ``p'`` as renormalising ``max(p' - q, 0)`` step by
step); child ``x`` is accepted iff ``u * q(x) * M < max(p(x) - c q(x), 0)``.
``"deterministic"``: ``p'(x) = p(x) / Z`` with ``Z = 1 - (mass of the distinct rejected
tokens)`` (``p`` is taken as normalised, as the chain sampler takes it) and ``p(x)`` read
as 0 for a rejected token; accepted iff ``p'(x) > 0`` and ``u * Z < p(x)``. The extra
token is the exponential race ``argmax(r / noise)`` over the unnormalised residual ``r``.

Edge cases, decided as ``verify.py`` decides them for chains
-----------------------------------------------------------
* A request with 0 nodes emits one token from its root row.
* ``q(x) = 0`` (sampled rule; MTAD: ``q = 0`` makes ``S = -inf``) rejects the child, and
  so does a token outside ``[0, V)``; ``p(x) = 0`` is never accepted by a sampled rule.
* A rejection whose residual has no mass (reachable only through rounding: ``p' == q``,
  or ``p`` all on rejected tokens) leaves ``p'`` as it was (``"sampled"``) or draws the
  extra token from ``p`` (``"deterministic"``): for one child both are the chain's
  "fall back to ``p``".
* The extra token of a sampled request is ``argmax(dist * (1 / max(noise, tiny)))``
  over its ``[V]`` row of Exp(1) noise; greedy requests ignore the noise.

The output, :class:`TreeVerdict`: ``output_token_ids`` ``[B, D + 1]`` (``D = max_depth``:
the accepted path's tokens, exactly one extra token, then -1, as the chain sampler's
output), ``accepted_nodes`` ``[B, D]`` (the accepted path's node indices within the
request, -1 padded: the engine moves those nodes' K/V into contiguous slots) and
``num_accepted`` ``[B]``.

Everything is vectorised over requests and nodes: the walks loop over depth and sibling
rank only (both small tree-shape constants known on the host), no ``.item()``/
``.tolist()`` in :func:`verify_tree`, and no data-dependent shapes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TREE_RULES",
    "MAX_TREE_NODES",
    "MAX_TREE_DEPTH",
    "DEFAULT_TREE_KNOB",
    "TreeBatch",
    "TreeLayout",
    "TreeVerdict",
    "StaticTree",
    "DraftTree",
    "Expansion",
    "node_depths",
    "ancestor_mask",
    "tree_layout",
    "tree_attention_mask",
    "tree_from_paths",
    "tree_from_beams",
    "expand_frontier",
    "validate_tree_knob",
    "verify_tree",
]

TREE_RULES: tuple[str, ...] = ("sampled", "deterministic", "mtad")

# The knob's limits: a tree is fed to the target as one ragged run of query tokens per
# request, and the issue measures the target's cost up to 32 of them; 64 leaves room.
MAX_TREE_NODES = 64
MAX_TREE_DEPTH = 16
DEFAULT_TREE_KNOB: dict[str, int] = {"max_nodes": 16, "max_depth": 5, "branching": 4}

PLACEHOLDER_TOKEN_ID = -1
# Smallest normal float32: 1 / TINY is finite, so a zero noise sample cannot make 0 * inf.
_TINY = torch.finfo(torch.float32).tiny
# Largest float32 below 1 (see verify.as_float32_uniforms: a float64 uniform rounded to
# 1.0 would reject a token with p == q).
_BELOW_ONE = 1.0 - 2.0**-24
# Parent value of padding slots in the [B, N] layout: matches no node and not the root.
_NO_PARENT = -2


def _shape_error(name: str, expected: str, got: torch.Tensor) -> ValueError:
    return ValueError(f"{name} must be {expected}, got {tuple(got.shape)}")


# --------------------------------------------------------------------------------------
# The batch and its shape
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeBatch:
    """B requests' draft trees, each flattened breadth-first, laid out ragged like
    ``VerifyBatch``: request b owns nodes ``[cu[b] - n_b, cu[b])``.

    Fields:
        token_ids: [T] int64 draft token of each node.
        parents: [T] int64 parent's index WITHIN its request (``0..n_b-1``), ``-1`` = a
            child of the root; ``parent < own index``.
        cu_num_nodes: [B] int64 inclusive cumulative sum of ``n_b`` (``n_b`` may be 0).
        max_num_nodes / max_depth / max_children: host-side bounds on the largest
            ``n_b``, the deepest node and the most children of one node (root included).
            Upper bounds are fine (they only size loops and padding). ``None``: computed
            from the data, which reads the tensors on the host: pass them when the
            tensors live on an accelerator.

    Validated on construction (shapes always; on CPU tensors also the values: parents in
    range and before their node, counts non-negative, the bounds not below the data);
    a bad field raises ``ValueError`` naming it.
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    cu_num_nodes: torch.Tensor
    max_num_nodes: int | None = None
    max_depth: int | None = None
    max_children: int | None = None

    def __post_init__(self) -> None:
        if self.token_ids.ndim != 1:
            raise _shape_error("token_ids", "[T]", self.token_ids)
        t = self.token_ids.shape[0]
        if tuple(self.parents.shape) != (t,):
            raise _shape_error("parents", f"[T={t}]", self.parents)
        if self.cu_num_nodes.ndim != 1:
            raise _shape_error("cu_num_nodes", "[B]", self.cu_num_nodes)
        for name in ("token_ids", "parents", "cu_num_nodes"):
            tensor = getattr(self, name)
            if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
                raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")
        for name in ("max_num_nodes", "max_depth", "max_children"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        on_cpu = self.cu_num_nodes.device.type == "cpu"
        bounds = (self.max_num_nodes, self.max_depth, self.max_children)
        if on_cpu or any(b is None for b in bounds):
            self._check_values_and_fill_bounds()

    @property
    def num_requests(self) -> int:
        return self.cu_num_nodes.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[0]

    def num_nodes_per_request(self) -> torch.Tensor:
        """[B] int64 ``n_b``."""
        cu = self.cu_num_nodes.to(torch.int64)
        return cu - torch.cat([cu.new_zeros(1), cu[:-1]])

    def _check_values_and_fill_bounds(self) -> None:
        cu = self.cu_num_nodes.to(torch.int64).cpu()
        t = self.num_nodes
        counts = cu - torch.cat([cu.new_zeros(1), cu[:-1]])
        if len(cu) and (int(counts.min()) < 0 or int(cu[-1]) != t):
            raise ValueError(
                f"cu_num_nodes must be a non-decreasing inclusive cumulative sum ending at "
                f"T={t}, got {cu.tolist()}"
            )
        if not len(cu) and t:
            raise ValueError(f"cu_num_nodes is empty (B=0) but there are T={t} nodes")
        parents = self.parents.to(torch.int64).cpu()
        start = torch.repeat_interleave(cu - counts, counts)
        local = torch.arange(t, dtype=torch.int64) - start
        bad = (parents < -1) | (parents >= local)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"parents[{i}] = {int(parents[i])} is not allowed for node {int(local[i])} of "
                f"its request: a parent is -1 (the root) or an earlier node of the same "
                f"request (0..{int(local[i]) - 1}), so the tree is in BFS order"
            )
        n_max = int(counts.max()) if len(cu) else 0
        if self.max_depth is not None:
            rounds = max(self.max_depth - 1, 0).bit_length() + 1
            depths, deeper = _pointer_jump(parents, cu, rounds)
            if bool(deeper.any()) or (t and int(depths.max()) > self.max_depth):
                raise ValueError(f"max_depth = {self.max_depth} is below the batch's deepest node")
        else:
            depths = node_depths(parents, cu)
        d_max = int(depths.max()) if t else 0
        if t:
            # Children per node, the root counted as slot 0 of each request.
            owner = torch.repeat_interleave(torch.arange(len(cu)), counts)
            slot = owner * (n_max + 1) + parents + 1
            c_max = int(torch.bincount(slot).max())
        else:
            c_max = 0
        for name, actual in (("max_num_nodes", n_max), ("max_depth", d_max),
                             ("max_children", c_max)):
            given = getattr(self, name)
            if given is None:
                object.__setattr__(self, name, actual)
            elif given < actual:
                raise ValueError(f"{name} = {given} is below the batch's actual {actual}")


def _pointer_jump(
    parents: torch.Tensor, cu_num_nodes: torch.Tensor, rounds: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth, unresolved) after ``rounds`` rounds of pointer jumping over the flat parent
    links: "add the ancestor's distance, jump to the ancestor's ancestor". Round r covers
    ``2**r`` edges; ``unresolved`` marks nodes deeper than that."""
    t = parents.shape[0]
    cu = cu_num_nodes.to(torch.int64)
    counts = cu - torch.cat([cu.new_zeros(1), cu[:-1]])
    start = torch.repeat_interleave(cu - counts, counts, output_size=t)
    par = parents.to(torch.int64)
    anc = torch.where(par >= 0, start + par, torch.full_like(par, -1))
    dist = torch.ones(t, dtype=torch.int64, device=parents.device)
    zero = torch.zeros_like(dist)
    for _ in range(rounds):
        up = anc >= 0
        safe = anc.clamp(min=0)
        dist = dist + torch.where(up, dist.index_select(0, safe), zero)
        anc = torch.where(up, anc.index_select(0, safe), anc)
    return dist, anc >= 0


def node_depths(
    parents: torch.Tensor, cu_num_nodes: torch.Tensor, max_depth: int | None = None
) -> torch.Tensor:
    """[T] int64 depth of every node (1 = a child of the root), no host sync.

    Pointer jumping: ``bit_length(max_depth - 1) + 1`` rounds when the caller knows a
    bound on the depth (a :class:`TreeBatch` does), ``bit_length(T - 1) + 1`` otherwise.
    """
    bound = parents.shape[0] if max_depth is None else max_depth
    return _pointer_jump(parents, cu_num_nodes, max(bound - 1, 0).bit_length() + 1)[0]


def ancestor_mask(parents_of_one_request: torch.Tensor) -> torch.Tensor:
    """[n, n] bool: ``[i, j]`` is True when node j is node i or one of its ancestors."""
    par = parents_of_one_request.to(torch.int64)
    n = par.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=par.device)
    rows = torch.arange(n, device=par.device)
    cur = par
    for _ in range(n):  # a path has at most n - 1 ancestors
        up = cur >= 0
        mask[rows[up], cur[up]] = True
        cur = torch.where(up, par[cur.clamp(min=0)], cur)
    return mask


@dataclass(frozen=True)
class TreeLayout:
    """The ragged trees padded to ``[B, N]`` views (``N = max_num_nodes``).

    ``start``/``num``: [B] first flat node and node count. ``valid``: [B, N] slot holds a
    node. ``flat``: [B, N] its flat index (clamped in bounds). ``parent``: [B, N] local
    parent (-1 root, -2 padding). ``depth``: [B, N] (0 padding). ``rank``: [B, N] how many
    earlier siblings the node has. ``root_row``: [B] the request's row 0 in ``node_probs``.
    """

    start: torch.Tensor
    num: torch.Tensor
    valid: torch.Tensor
    flat: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    root_row: torch.Tensor
    num_nodes: int
    max_num_nodes: int
    max_depth: int
    max_children: int


def tree_layout(batch: TreeBatch) -> TreeLayout:
    """Padded ``[B, N]`` indexing of a :class:`TreeBatch` (no host sync)."""
    assert batch.max_num_nodes is not None and batch.max_depth is not None
    assert batch.max_children is not None  # filled in by TreeBatch
    n_max, t = batch.max_num_nodes, batch.num_nodes
    cu = batch.cu_num_nodes.to(torch.int64)
    dev = cu.device
    num = cu - torch.cat([cu.new_zeros(1), cu[:-1]])
    start = cu - num
    slots = torch.arange(n_max, device=dev, dtype=torch.int64)
    valid = slots[None, :] < num[:, None]
    flat = (start[:, None] + slots[None, :]).clamp(min=0, max=max(t - 1, 0))
    if t:
        parent = batch.parents.to(torch.int64)[flat]
        depth = node_depths(batch.parents, cu, batch.max_depth)[flat]
    else:
        parent = torch.zeros_like(flat)
        depth = torch.zeros_like(flat)
    parent = torch.where(valid, parent, torch.full_like(parent, _NO_PARENT))
    depth = torch.where(valid, depth, torch.zeros_like(depth))
    # rank[b, i] = earlier valid siblings: [B, N, N] comparisons, N is small.
    earlier = slots[None, :] < slots[:, None]  # [i, j]: j < i
    same = (parent[:, :, None] == parent[:, None, :]) & earlier[None] & valid[:, None, :]
    rank = same.sum(dim=2)
    root_row = start + torch.arange(cu.shape[0], device=dev, dtype=torch.int64)
    return TreeLayout(start, num, valid, flat, parent, depth, rank, root_row, t, n_max,
                      batch.max_depth, batch.max_children)


def tree_attention_mask(batch: TreeBatch) -> torch.Tensor:
    """[B, N + 1, N + 1] bool over (root, nodes) as query x key: True where the query may
    attend. The root attends to itself; node i to the root, its ancestors and itself.
    Padding slots (beyond ``n_b``) attend to themselves only, so no row is empty.
    (The context before the root is visible to every query; not part of this mask.)
    """
    layout = tree_layout(batch)
    b, n = layout.valid.shape
    dev = layout.valid.device
    mask = torch.eye(n + 1, dtype=torch.bool, device=dev).expand(b, n + 1, n + 1).clone()
    mask[:, 1:, 0] = layout.valid
    cur = layout.parent  # [B, N] local ancestor, -1 root, -2 pad
    cols = torch.arange(n, device=dev)
    for _ in range(layout.max_depth):
        up = cur >= 0
        # [b, i, 1 + cur] = True where up
        hit = (cur.clamp(min=0)[:, :, None] == cols[None, None, :]) & up[:, :, None]
        mask[:, 1:, 1:] |= hit
        cur = torch.where(up, layout.parent.gather(1, cur.clamp(min=0)), cur)
    return mask


# --------------------------------------------------------------------------------------
# Static trees (vLLM's old speculative_token_tree) and the draft_tree knob
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape, from a list of child-rank paths, in BFS order.

    ``paths[i]``: node i's path of child ranks from the root (rank 0 = the drafter's most
    likely child); ``parents[i]`` (-1 = root), ``depths[i]``, ``child_ranks[i]`` (the
    path's last rank). Sorted by (length, path), as vLLM's ``speculative_token_tree``.
    """

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    child_ranks: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def max_children(self) -> int:
        """The most children of one node, the root included."""
        counts: dict[int, int] = {}
        for p in self.parents:
            counts[p] = counts.get(p, 0) + 1
        return max(counts.values(), default=0)

    def parents_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.parents, dtype=torch.int64, device=device)


def _path_problems(
    paths: Any, max_nodes: int, max_depth: int, where: str
) -> tuple[list[str], list[tuple[int, ...]]]:
    """(problems, parsed paths): every problem ONE line naming ``where``."""
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
        return [f"{where} = {paths!r} is not allowed: it must be a list of paths, each a "
                f"list of child ranks such as [[0], [1], [0, 0]]"], []
    problems: list[str] = []
    parsed: list[tuple[int, ...]] = []
    if not paths:
        problems.append(f"{where} = [] is not allowed: a tree needs at least one path")
    for k, path in enumerate(paths):
        if isinstance(path, (str, bytes)) or not isinstance(path, Sequence) or not path:
            problems.append(
                f"{where}[{k}] = {path!r} is not allowed: a path is a non-empty list of child "
                f"ranks (integers >= 0) from the root, such as [0, 1]"
            )
            continue
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path):
            problems.append(
                f"{where}[{k}] = {list(path)!r} is not allowed: child ranks are integers >= 0"
            )
            continue
        parsed.append(tuple(path))
    seen: set[tuple[int, ...]] = set()
    for path in parsed:
        if path in seen:
            problems.append(f"{where} lists the path {list(path)} twice: each node once")
        seen.add(path)
    for path in parsed:
        if len(path) > 1 and path[:-1] not in seen:
            problems.append(
                f"{where} has the path {list(path)} but not its prefix {list(path[:-1])}: "
                f"every node's parent must be in the tree"
            )
    if len(seen) > max_nodes:
        problems.append(
            f"{where} has {len(seen)} nodes, more than the limit {max_nodes}"
        )
    deepest = max((len(p) for p in parsed), default=0)
    if deepest > max_depth:
        problems.append(f"{where} has a path of depth {deepest}, more than the limit {max_depth}")
    return problems, parsed


def tree_from_paths(
    paths: Sequence[Sequence[int]],
    *,
    max_nodes: int = MAX_TREE_NODES,
    max_depth: int = MAX_TREE_DEPTH,
) -> StaticTree:
    """A :class:`StaticTree` from child-rank paths (vLLM's ``speculative_token_tree``
    format: ``[(0,), (1,), (0, 0)]`` = the top-2 children of the root and the top child of
    the first). Raises ``ValueError`` with one line per problem (missing prefix, duplicate,
    bad rank, too many nodes or too deep)."""
    problems, parsed = _path_problems(paths, max_nodes, max_depth, "paths")
    if problems:
        raise ValueError("; ".join(problems))
    ordered = sorted(parsed, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(ordered)}
    return StaticTree(
        paths=tuple(ordered),
        parents=tuple(index[p[:-1]] if len(p) > 1 else -1 for p in ordered),
        depths=tuple(len(p) for p in ordered),
        child_ranks=tuple(p[-1] for p in ordered),
    )


def _int_problem(where: str, value: Any, low: int, high: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        return f"{where} = {value!r} is not allowed: an integer from {low} to {high}"
    return None


def validate_tree_knob(value: Any) -> list[str]:
    """Problems with a ``draft_tree`` knob value, one line each (empty: it is fine).

    Allowed: ``{"paths": [[0], [1], [0, 0], ...]}`` (a static tree, see
    :func:`tree_from_paths`) or a dynamic tree ``{"max_nodes": N, "max_depth": D,
    "branching": K}`` (each key optional, defaults ``DEFAULT_TREE_KNOB``, a default D or K
    at most the N given): N in
    1..MAX_TREE_NODES, D in 1..min(N, MAX_TREE_DEPTH), K in 1..N.
    """
    key = 'draft_tree'
    shapes = ('{"max_nodes": 16, "max_depth": 5, "branching": 4} or '
              '{"paths": [[0], [1], [0, 0]]}')
    if not isinstance(value, Mapping):
        return [f"{key} = {value!r} is not allowed: it must be a dict such as {shapes}"]
    dynamic = set(DEFAULT_TREE_KNOB)
    unknown = sorted(str(k) for k in value if k not in dynamic | {"paths"})
    if unknown:
        return [f"{key} has unknown keys {unknown}: allowed are {shapes}"]
    if "paths" in value:
        mixed = sorted(k for k in value if k in dynamic)
        if mixed:
            return [f"{key} mixes \"paths\" with {mixed}: a static tree is given by its "
                    f"paths alone; use either {shapes}"]
        return _path_problems(value["paths"], MAX_TREE_NODES, MAX_TREE_DEPTH,
                              f'{key}["paths"]')[0]
    merged = {**DEFAULT_TREE_KNOB, **value}
    n = merged["max_nodes"]
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
        # A default never exceeds the nodes given: {"max_nodes": 2} is a 2-node tree of
        # depth <= 2 and branching <= 2 (methods.draft_model_tree reads it the same way).
        merged = {**{k: min(v, n) for k, v in DEFAULT_TREE_KNOB.items()}, **value}
    problems = []
    limits = {"max_nodes": (1, MAX_TREE_NODES), "max_depth": (1, MAX_TREE_DEPTH),
              "branching": (1, MAX_TREE_NODES)}
    for name, (low, high) in limits.items():
        problem = _int_problem(f'{key}["{name}"]', merged[name], low, high)
        if problem:
            problems.append(problem)
    if not problems:
        n, d, k = merged["max_nodes"], merged["max_depth"], merged["branching"]
        if d > n:
            problems.append(f'{key}["max_depth"] = {d} is not allowed: a tree of max_nodes '
                            f'= {n} nodes is at most {n} deep')
        if k > n:
            problems.append(f'{key}["branching"] = {k} is not allowed: a node cannot have '
                            f'more children than max_nodes = {n}')
    return problems


# --------------------------------------------------------------------------------------
# Dynamic trees from per-depth candidates (EAGLE-2, MTAD's beams)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftTree:
    """Trees built by :func:`tree_from_beams`, padded to ``[B, max_nodes]`` in BFS order.

    ``token_ids`` (-1 padding), ``parents`` (local, -1 root, -1 padding), ``depths`` (0
    padding), ``scores`` (cumulative draft log-probability, -inf padding),
    ``token_logprobs`` (draft log q of the node's own token given its parent; -inf padding;
    ``None`` when not given), ``source_depth``/``source_index`` (the candidate the node came
    from: its depth 0..D-1 and column, -1 padding), ``num_nodes`` [B].
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    token_logprobs: torch.Tensor | None
    source_depth: torch.Tensor
    source_index: torch.Tensor
    num_nodes: torch.Tensor
    max_depth: int

    def flat(self, per_node: torch.Tensor) -> torch.Tensor:
        """A ``[B, max_nodes, ...]`` per-node tensor in the ragged flat layout (host sync)."""
        width = self.token_ids.shape[1]
        keep = torch.arange(width, device=self.num_nodes.device)[None, :] < self.num_nodes[:, None]
        return per_node[keep]

    def to_batch(self, max_children: int | None = None) -> TreeBatch:
        """The ragged :class:`TreeBatch` (reads ``num_nodes`` on the host)."""
        return TreeBatch(
            token_ids=self.flat(self.token_ids),
            parents=self.flat(self.parents),
            cu_num_nodes=torch.cumsum(self.num_nodes, 0),
            max_num_nodes=self.token_ids.shape[1],
            max_depth=self.max_depth,
            max_children=max_children,
        )


def tree_from_beams(
    tokens: Sequence[torch.Tensor],
    parents: Sequence[torch.Tensor],
    scores: Sequence[torch.Tensor],
    max_nodes: int,
    *,
    token_logprobs: Sequence[torch.Tensor] | None = None,
    sibling_order: str = "score",
    merge_duplicates: bool = True,
) -> DraftTree:
    """Merge per-depth draft candidates into a trie and keep the best ``max_nodes``.

    Per depth ``d`` (0-based), ``[B, W_d]`` tensors: ``tokens[d]``, ``parents[d]`` (the
    column of the candidate at depth ``d - 1`` it extends; ignored at depth 0),
    ``scores[d]`` (its cumulative draft log-probability, the sum of log q along its path;
    ``-inf`` or NaN = dead, and so is every candidate extending a dead one). That is what
    MTAD's beam search produces each step (``BeamStep``: scores, parents, tokens,
    token_logprobs) and what an EAGLE-2 expansion produces (top-k children of the top
    nodes of the previous depth).

    Candidates with the same (parent node, token) are one node (the first one's data is
    kept). The kept nodes are the ``max_nodes`` best by score, ties to the shallower then
    earlier candidate. A node's score is capped at its parent's (log q <= 0 makes that a
    no-op for real drafters), so the kept set is always ancestor-closed. The output is in
    BFS order: by depth, then by parent, then children by score (``sibling_order =
    "score"``, best first) or in the candidates' column order (``"input"``: keep i.i.d.
    draws in draw order, which the ``"sampled"`` rule needs). Vectorised over requests.

    For the ``"sampled"`` rule the children of a node must stay i.i.d. draws: pass
    ``merge_duplicates=False`` (a merged duplicate skips the residual update its rejection
    would make), ``sibling_order="input"``, and a ``max_nodes`` that keeps every candidate
    (keeping the likelier draws is a choice by value). Pruned or merged trees, EAGLE-2's
    included, are verified with ``"deterministic"``, which is lossless for them.
    """
    depth_count = len(tokens)
    if depth_count == 0 or len(parents) != depth_count or len(scores) != depth_count:
        raise ValueError(
            f"tokens, parents and scores need one [B, W_d] tensor per depth (>= 1 depth), got "
            f"{len(tokens)}, {len(parents)}, {len(scores)}"
        )
    if token_logprobs is not None and len(token_logprobs) != depth_count:
        raise ValueError(f"token_logprobs has {len(token_logprobs)} depths, not {depth_count}")
    if sibling_order not in ("score", "input"):
        raise ValueError(f"sibling_order {sibling_order!r} is not 'score' or 'input'")
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    b = tokens[0].shape[0]
    dev = tokens[0].device
    for d in range(depth_count):
        shape = tuple(tokens[d].shape)
        if len(shape) != 2 or shape[0] != b:
            raise _shape_error(f"tokens[{d}]", f"[B={b}, W]", tokens[d])
        for name, seq in (("parents", parents), ("scores", scores),
                          ("token_logprobs", token_logprobs)):
            if seq is not None and tuple(seq[d].shape) != shape:
                raise _shape_error(f"{name}[{d}]", f"{list(shape)}", seq[d])

    widths = [int(t.shape[1]) for t in tokens]
    offsets = [sum(widths[:d]) for d in range(depth_count)]
    neg_inf = torch.tensor(-math.inf, device=dev)
    canon_all: list[torch.Tensor] = []  # local column of each candidate's canonical copy
    eff_all: list[torch.Tensor] = []  # capped score, -inf = dead (duplicates included)
    score_all: list[torch.Tensor] = []  # selection keys: -inf for dead and duplicates
    depth_all: list[torch.Tensor] = []
    col_all: list[torch.Tensor] = []
    parent_all: list[torch.Tensor] = []  # global index of the canonical parent (-1 root)
    for d in range(depth_count):
        w = widths[d]
        tok = tokens[d].to(torch.int64)
        sc = scores[d].to(torch.float32)
        alive = ~torch.isnan(sc) & (sc > -math.inf)
        if d == 0:
            par = torch.full((b, w), -1, dtype=torch.int64, device=dev)
        else:
            pcol = parents[d].to(torch.int64).clamp(0, widths[d - 1] - 1)
            # Link to the parent's canonical copy, and cap by ITS score, so a child never
            # outranks the node it hangs from (the kept set stays ancestor-closed).
            pcanon = canon_all[d - 1].gather(1, pcol)
            parent_score = eff_all[d - 1].gather(1, pcanon)
            alive = alive & (parent_score > -math.inf)
            sc = torch.minimum(sc, parent_score)
            par = pcanon + offsets[d - 1]
        sc = torch.where(alive, sc, neg_inf)
        # First alive candidate with the same (parent, token): [B, W, W].
        same = (par[:, :, None] == par[:, None, :]) & (tok[:, :, None] == tok[:, None, :])
        cols = torch.arange(w, device=dev)
        same = same & alive[:, None, :] & (cols[None, :] <= cols[:, None])[None]
        first = same.to(torch.int32).argmax(dim=2)  # alive rows always match themselves
        if not merge_duplicates:
            first = cols[None, :].expand(b, w)
        canon_local = torch.where(alive, first, cols[None, :].expand(b, w))
        canon_all.append(canon_local)
        eff_all.append(sc)
        is_canon = alive & (canon_local == cols[None, :])
        score_all.append(torch.where(is_canon, sc, neg_inf))
        depth_all.append(torch.full((b, w), d + 1, dtype=torch.int64, device=dev))
        col_all.append(cols[None, :].expand(b, w))
        parent_all.append(par)
    keys = torch.cat(score_all, dim=1)  # [B, M]
    m = keys.shape[1]
    take = min(max_nodes, m)
    # Stable descending sort: ties keep the depth-major candidate order.
    sorted_keys, order = torch.sort(keys, dim=1, descending=True, stable=True)
    chosen = order[:, :take]
    chosen_alive = sorted_keys[:, :take] > -math.inf
    kept = torch.zeros(b, m, dtype=torch.bool, device=dev)
    kept.scatter_(1, chosen, chosen_alive)
    num_nodes = kept.sum(dim=1)

    all_tok = torch.cat([t.to(torch.int64) for t in tokens], dim=1)
    all_par = torch.cat(parent_all, dim=1)
    all_depth = torch.cat(depth_all, dim=1)
    all_col = torch.cat(col_all, dim=1)
    all_lp = (torch.cat([t.to(torch.float32) for t in token_logprobs], dim=1)
              if token_logprobs is not None else None)
    # BFS numbering, depth by depth: order depth-d kept nodes by (parent's new index,
    # sibling key), after all shallower kept nodes.
    new_index = torch.full((b, m), -1, dtype=torch.int64, device=dev)
    before = torch.zeros(b, dtype=torch.int64, device=dev)
    for d in range(depth_count):
        lo, hi = offsets[d], offsets[d] + widths[d]
        k_d = kept[:, lo:hi]
        par = all_par[:, lo:hi]
        par_new = torch.where(par >= 0, new_index.gather(1, par.clamp(min=0)),
                              torch.full_like(par, -1))
        if sibling_order == "score":
            sib_order = torch.sort(keys[:, lo:hi], dim=1, descending=True, stable=True)[1]
        else:
            sib_order = torch.arange(hi - lo, device=dev).expand(b, hi - lo)
        # Then by parent (stable keeps the sibling order), unkept last.
        group = torch.where(k_d, par_new, torch.full_like(par_new, max_nodes + 1))
        grp_order = torch.sort(group.gather(1, sib_order), dim=1, stable=True)[1]
        perm = sib_order.gather(1, grp_order)  # columns in final order
        pos = torch.empty_like(perm)
        pos.scatter_(1, perm, torch.arange(hi - lo, device=dev).expand(b, hi - lo).contiguous())
        idx = torch.where(k_d, before[:, None] + pos, torch.full_like(pos, -1))
        new_index[:, lo:hi] = idx
        before = before + k_d.sum(dim=1)

    # Scatter the kept candidates into their slots (one spare slot takes the unkept).
    slot = torch.where(kept, new_index, torch.full_like(new_index, max_nodes))

    def place(values: torch.Tensor, fill: float | int) -> torch.Tensor:
        out = values.new_full((b, max_nodes + 1), fill)
        out.scatter_(1, slot, values)
        return out[:, :max_nodes]

    par_new_all = torch.where(all_par >= 0, new_index.gather(1, all_par.clamp(min=0)),
                              torch.full_like(all_par, -1))
    return DraftTree(
        token_ids=place(all_tok, PLACEHOLDER_TOKEN_ID),
        parents=place(par_new_all, -1),
        depths=place(all_depth, 0),
        scores=place(keys, -math.inf),
        token_logprobs=None if all_lp is None else place(all_lp, -math.inf),
        source_depth=place(all_depth - 1, -1),
        source_index=place(all_col, -1),
        num_nodes=num_nodes,
        max_depth=depth_count,
    )


@dataclass(frozen=True)
class Expansion:
    """One depth of a dynamic tree (:func:`expand_frontier`), ``[B, W * k]`` candidates
    in the format :func:`tree_from_beams` takes per depth, plus the next frontier.

    ``tokens``, ``parents`` (the column of each child's parent among the PREVIOUS depth's
    candidates), ``scores`` (cumulative draft log-probability, -inf: dead),
    ``token_logprobs``; frontier node ``j``'s children are columns ``j * k .. j * k + k - 1``.
    ``frontier`` [B, width]: the columns to expand next, best first;
    ``frontier_scores`` [B, width] their scores (-inf pads a row with too few live ones).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    token_logprobs: torch.Tensor
    frontier: torch.Tensor
    frontier_scores: torch.Tensor


def expand_frontier(
    logprobs: torch.Tensor,
    frontier_scores: torch.Tensor,
    frontier_columns: torch.Tensor | None,
    branching: int,
    width: int,
    *,
    sample: bool = False,
    generator: torch.Generator | None = None,
) -> Expansion:
    """EAGLE-2's expansion step: the top ``branching`` children of every frontier node, and
    the ``width`` best of them (by cumulative draft probability) as the next frontier.

    ``logprobs`` [B, W, V]: the drafter's (warped) next-token log-probabilities after each
    frontier node (W = 1 with the root at depth 0). ``frontier_scores`` [B, W]: their
    cumulative log-probabilities (zeros for the root; -inf: dead, whose children are dead).
    ``frontier_columns`` [B, W]: their columns among the previous depth's candidates
    (None at the root). ``sample=True`` draws the children i.i.d. from the drafter instead
    (with replacement, in draw order: the ``"sampled"`` rule's proposal; keep every draw
    when building the tree, see :func:`tree_from_beams`). Greedy top-k keeps ties in
    ``torch.topk`` order. Vectorised; the drafter runs one batched pass per depth over
    the ``width`` frontier nodes.
    """
    if logprobs.ndim != 3:
        raise _shape_error("logprobs", "[B, W, V]", logprobs)
    b, w, vocab = logprobs.shape
    if tuple(frontier_scores.shape) != (b, w):
        raise _shape_error("frontier_scores", f"[B={b}, W={w}]", frontier_scores)
    if frontier_columns is not None and tuple(frontier_columns.shape) != (b, w):
        raise _shape_error("frontier_columns", f"[B={b}, W={w}]", frontier_columns)
    if branching < 1 or (not sample and branching > vocab) or width < 1:
        raise ValueError(f"branching must be >= 1 (<= V={vocab} for top-k children) and "
                         f"width >= 1, got {branching} and {width}")
    lp = logprobs.to(torch.float32)
    if sample:
        flat = lp.reshape(b * w, vocab).exp()
        # A dead frontier node may hold any finite row; one with no mass draws token 0.
        flat = torch.where(flat.sum(dim=1, keepdim=True) > 0, flat, torch.ones_like(flat))
        tokens = torch.multinomial(flat, branching, replacement=True, generator=generator)
        tokens = tokens.view(b, w, branching)
        child_lp = lp.gather(2, tokens)
    else:
        child_lp, tokens = lp.topk(branching, dim=2)
    base = frontier_scores.to(torch.float32)
    dead = torch.isnan(base) | (base == -math.inf)
    scores = torch.where(dead[:, :, None], torch.full_like(child_lp, -math.inf),
                         base[:, :, None] + child_lp)
    scores = torch.where(torch.isnan(scores), torch.full_like(scores, -math.inf), scores)
    cols = (frontier_columns.to(torch.int64) if frontier_columns is not None
            else torch.zeros(b, w, dtype=torch.int64, device=lp.device))
    parents = cols[:, :, None].expand(b, w, branching)
    n = w * branching
    scores = scores.reshape(b, n)
    take = min(width, n)
    top_scores, top_cols = scores.topk(take, dim=1)
    if take < width:
        pad = width - take
        top_cols = torch.cat([top_cols, top_cols.new_zeros(b, pad)], dim=1)
        top_scores = torch.cat([top_scores, top_scores.new_full((b, pad), -math.inf)], dim=1)
    return Expansion(
        tokens=tokens.reshape(b, n),
        parents=parents.reshape(b, n),
        scores=scores,
        token_logprobs=child_lp.reshape(b, n),
        frontier=top_cols,
        frontier_scores=top_scores,
    )


# --------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeVerdict:
    """What :func:`verify_tree` decided, per request.

    ``output_token_ids``: [B, D + 1] int64, the accepted path's tokens, one extra token,
    then -1. ``accepted_nodes``: [B, D] int64 node indices within the request along the
    accepted path, -1 padded. ``num_accepted``: [B] int64.
    """

    output_token_ids: torch.Tensor
    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor


def _valid_ids(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ok = (ids >= 0) & (ids < vocab)
    return ok, torch.where(ok, ids, torch.zeros_like(ids))


def _race(dist: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """[B] argmax(dist / noise): a sample of dist / sum(dist) (verify.sample_extra_token)."""
    inv_noise = exp_noise.to(torch.float32).clamp(min=_TINY).reciprocal()
    return (dist * inv_noise).argmax(dim=-1)


def _check_inputs(
    batch: TreeBatch,
    node_probs: torch.Tensor,
    rule: str,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor | None,
    exp_noise: torch.Tensor | None,
    target_argmax: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    draft_token_probs: torch.Tensor | None,
    acceptance_threshold: float,
    all_greedy: bool,
) -> None:
    if rule not in TREE_RULES:
        raise ValueError(f"tree rule {rule!r} is not one of {', '.join(TREE_RULES)}")
    b, t = batch.num_requests, batch.num_nodes
    if node_probs.ndim != 2 or node_probs.shape[0] != t + b:
        raise _shape_error("node_probs", f"[T + B = {t + b}, V]", node_probs)
    v = node_probs.shape[1]
    expected: list[tuple[str, torch.Tensor | None, tuple[int, ...], str]] = [
        ("is_greedy", is_greedy, (b,), f"[B={b}]"),
        ("uniforms", uniforms, (t,), f"[T={t}]"),
        ("exp_noise", exp_noise, (b, v), f"[B={b}, V={v}]"),
        ("target_argmax", target_argmax, (t + b,), f"[T + B = {t + b}]"),
        ("draft_probs", draft_probs, (t, v), f"[T={t}, V={v}]"),
        ("draft_token_probs", draft_token_probs, (t,), f"[T={t}]"),
    ]
    for name, tensor, shape, text in expected:
        if tensor is not None and tuple(tensor.shape) != shape:
            raise _shape_error(name, text, tensor)
    if not all_greedy:
        if uniforms is None or exp_noise is None:
            raise ValueError("uniforms [T] and exp_noise [B, V] are needed unless all_greedy")
        if rule == "sampled" and draft_probs is None:
            raise ValueError("rule='sampled' needs draft_probs [T, V]: the q row each child "
                             "was drawn from")
        if rule == "mtad" and draft_probs is None and draft_token_probs is None:
            raise ValueError("rule='mtad' needs draft_token_probs [T] (or draft_probs [T, V])")
    if rule == "mtad" and not 0.0 < acceptance_threshold <= 1.0:
        raise ValueError(f"acceptance_threshold must be in (0, 1], got {acceptance_threshold!r}")


def _node_rows(layout: TreeLayout, local: torch.Tensor) -> torch.Tensor:
    """[B] row in ``node_probs`` of each request's local node (-1 = the root)."""
    return layout.root_row + 1 + local


def _path_to(node: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """[B, D] the local nodes from depth 1 down to ``node`` (-1 = root: empty path)."""
    b, d_max = node.shape[0], layout.max_depth
    path = torch.full((b, d_max + 1), -1, dtype=torch.int64, device=node.device)
    if layout.max_num_nodes == 0:
        return path[:, :d_max]
    cur = node
    node_depth = layout.depth.gather(1, cur.clamp(min=0)[:, None]).squeeze(1)
    depth = torch.where(cur >= 0, node_depth, torch.zeros_like(cur))
    for step in range(d_max):
        up = cur >= 0
        col = torch.where(up, depth - 1 - step, torch.full_like(depth, d_max))
        path.scatter_(1, col.clamp(min=0)[:, None], cur[:, None])
        cur = torch.where(up, layout.parent.gather(1, cur.clamp(min=0)[:, None]).squeeze(1), cur)
    return path[:, :d_max]


def _pick(matrix: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[B] float32 ``matrix[rows[b], cols[b]]``: one value per request, no [B, V] copy."""
    return matrix[rows, cols].to(torch.float32)


def _walk(
    layout: TreeLayout,
    token_ids: torch.Tensor,
    node_probs: torch.Tensor,
    rule: str | None,
    is_greedy: torch.Tensor,
    target_argmax: torch.Tensor,
    uniforms: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The root-down walk of the greedy / sampled / deterministic rules.

    Returns (final local node [B], -1 = root; the unnormalised ``p'`` there [B, V], the
    extra token's distribution for sampled requests, or None when ``rule`` is None:
    greedy only).

    Per node only the children's own values are read (``p(x)``, ``q(x)``: one gather per
    request), not whole rows. The residuals are kept in closed form:

    * deterministic: ``p'`` is ``p`` without the distinct rejected tokens, so
      ``p'(x) = p(x) / Z`` with ``Z = 1 - (their mass)`` and ``p(x)`` read as 0 for a
      token already rejected; the rejected tokens are kept per request ([B, C]).
    * sampled: siblings are drawn from one row ``q`` (the parent's; the first child's
      ``draft_probs`` row is read), and after ``j`` rejections
      ``p' = max(p - c q, 0) / M`` with ``c = 0, M = 1`` at first and, at a rejection,
      ``c <- c + M``, ``M <- sum(max(p - c q, 0))``: the same ``p'`` as renormalising
      ``max(p' - q, 0)`` step by step (where ``p > c q``,
      ``max(p - c q, 0) / M - q = (p - (c + M) q) / M``), with one [B, V] reduction per
      rejection that a later sibling may still need, and none for a chain.
    """
    b = layout.num.shape[0]
    dev = layout.num.device
    vocab = node_probs.shape[1]
    cur = torch.full((b,), -1, dtype=torch.int64, device=dev)
    ids = token_ids.to(torch.int64)
    greedy = is_greedy.to(torch.bool)
    tgt = target_argmax.to(torch.int64)
    n_children = layout.max_children
    sampled = rule == "sampled"
    u_all = None if uniforms is None else uniforms.to(torch.float32).clamp(max=_BELOW_ONE)
    ones = torch.ones(b, dtype=torch.float32, device=dev)
    c = torch.zeros_like(ones)  # sampled: residual coefficient at the current node
    c_prev = torch.zeros_like(ones)
    m = ones  # sampled: its normaliser; deterministic: Z = 1 - removed mass
    removed = torch.full((b, max(n_children, 1)), -1, dtype=torch.int64, device=dev)
    if layout.num_nodes:
        active = torch.ones(b, dtype=torch.bool, device=dev)
        for _ in range(layout.max_depth):
            moved = torch.zeros(b, dtype=torch.bool, device=dev)
            nxt = torch.full((b,), -1, dtype=torch.int64, device=dev)
            here = _node_rows(layout, cur)
            argmax_here = tgt.index_select(0, here)
            child_of = (layout.parent == cur[:, None]) & layout.valid  # [B, N]
            if rule is not None and sampled and n_children > 1:
                # Rows for the [B, V] normalisers of later siblings.
                first = child_of.to(torch.int32).argmax(dim=1).to(torch.int64)
                first_flat = layout.flat.gather(1, first[:, None]).squeeze(1)
                assert draft_probs is not None
                p_row = node_probs.index_select(0, here).to(torch.float32)
                q_row = draft_probs.index_select(0, first_flat).to(torch.float32)
            for k in range(n_children):
                cand = child_of & (layout.rank == k)
                has = cand.any(dim=1) & active & ~moved
                child = cand.to(torch.int32).argmax(dim=1).to(torch.int64)
                flat = layout.flat.gather(1, child[:, None]).squeeze(1)
                x = ids.index_select(0, flat)
                accept = x == argmax_here  # -1 / out-of-range ids never equal an argmax
                if rule is not None:
                    assert u_all is not None
                    ok, safe = _valid_ids(x, vocab)
                    u = u_all.index_select(0, flat)
                    p_x = _pick(node_probs, here, safe)
                    reject = has & ~greedy
                    if sampled:
                        assert draft_probs is not None
                        q_x = _pick(draft_probs, flat, safe)
                        r_x = (p_x - c * q_x).clamp(min=0)
                        test = ok & (q_x > 0) & (u * q_x * m < r_x)
                        reject = reject & ~test
                        c_prev = torch.where(reject, c, c_prev)
                        c_next = c + m
                        if k + 1 < n_children:
                            # p - c q in one pass, clamped in place.
                            m_next = torch.addcmul(p_row, q_row, -c_next[:, None])
                            m_next = m_next.clamp_(min=0).sum(dim=1)
                            # No mass left (p' == q up to rounding): p' stays as it was.
                            keep = reject & (m_next > 0)
                            c = torch.where(keep, c_next, c)
                            m = torch.where(keep, m_next, m)
                        else:  # the last sibling: only the extra token reads c
                            c = torch.where(reject, c_next, c)
                    else:
                        dup = (removed == x[:, None]).any(dim=1)
                        r_x = torch.where(dup, torch.zeros_like(p_x), p_x)
                        test = ok & (r_x > 0) & (u * m < r_x)
                        reject = reject & ~test
                        drop = reject & ok & ~dup
                        removed[:, k] = torch.where(drop, x, removed[:, k])
                        m = torch.where(drop, m - p_x, m)
                    accept = torch.where(greedy, accept, test)
                accept = accept & has
                moved = moved | accept
                nxt = torch.where(accept, child, nxt)
            cur = torch.where(moved, nxt, cur)
            active = active & moved
            # A fresh node: nothing rejected there yet.
            c = torch.where(moved, torch.zeros_like(c), c)
            c_prev = torch.where(moved, torch.zeros_like(c_prev), c_prev)
            m = torch.where(moved, ones, m)
            removed = torch.where(moved[:, None], torch.full_like(removed, -1), removed)
    if rule is None:
        return cur, None
    # The extra token's distribution at the final node.
    p_final = node_probs.index_select(0, _node_rows(layout, cur)).to(torch.float32)
    if sampled:
        assert draft_probs is not None
        if layout.num_nodes == 0:
            return cur, p_final
        child_of = (layout.parent == cur[:, None]) & layout.valid
        first = child_of.to(torch.int32).argmax(dim=1).to(torch.int64)
        q_final = draft_probs.index_select(0, layout.flat.gather(1, first[:, None]).squeeze(1))
        q_final = q_final.to(torch.float32)
        # c = 0 (nothing rejected, or a leaf) gives p itself, exactly.
        dist = (p_final - c[:, None] * q_final).clamp(min=0)
        empty = dist.sum(dim=1) <= 0
        fallback = (p_final - c_prev[:, None] * q_final).clamp(min=0)
        return cur, torch.where(empty[:, None], fallback, dist)
    # Zero the rejected tokens; unused slots (-1) write into a spare column V.
    idx = torch.where(removed >= 0, removed, torch.full_like(removed, vocab))
    padded = torch.cat([p_final, p_final.new_zeros(b, 1)], dim=1)
    dist = padded.scatter(1, idx, 0.0)[:, :vocab]
    empty = dist.sum(dim=1) <= 0
    return cur, torch.where(empty[:, None], p_final, dist)


def _mtad_choice(
    layout: TreeLayout,
    token_ids: torch.Tensor,
    node_probs: torch.Tensor,
    draft_token_probs: torch.Tensor,
    acceptance_threshold: float,
) -> torch.Tensor:
    """[B] local node MTAD accepts (-1 = root): the deepest with ``S > log tau``."""
    b, n = layout.valid.shape
    dev = layout.valid.device
    if layout.num_nodes == 0 or n == 0:
        return torch.full((b,), -1, dtype=torch.int64, device=dev)
    vocab = node_probs.shape[1]
    ok, safe = _valid_ids(token_ids.to(torch.int64), vocab)
    ok_p, safe_p = ok[layout.flat], safe[layout.flat]  # [B, N]
    parent_local = layout.parent.clamp(min=-1)
    parent_row = layout.root_row[:, None] + 1 + parent_local  # row of the parent's dist
    p_x = node_probs.reshape(-1)[(parent_row * vocab + safe_p).reshape(-1)].view(b, n)
    p_x = p_x.to(torch.float32)
    q_x = draft_token_probs.to(torch.float32)[layout.flat]
    good = ok_p & (p_x > 0) & (q_x > 0) & layout.valid
    one = torch.ones_like(p_x)
    log_p = torch.log(torch.where(good, p_x, one))
    log_q = torch.log(torch.where(good, q_x, one))
    neg = torch.full_like(p_x, -math.inf)
    term = torch.where(good, log_p - log_q, neg)
    lq = torch.where(good, log_q, neg)
    # Path sums: s = term + s[parent], iterated to the maximum depth.
    s, joint = term, lq
    has_parent = layout.parent >= 0
    up = layout.parent.clamp(min=0)
    for _ in range(layout.max_depth - 1):
        s = term + torch.where(has_parent, s.gather(1, up), torch.zeros_like(s))
        joint = lq + torch.where(has_parent, joint.gather(1, up), torch.zeros_like(joint))
    passes = layout.valid & (s > math.log(acceptance_threshold))
    depth = torch.where(passes, layout.depth, torch.zeros_like(layout.depth))
    deepest = depth.amax(dim=1)
    cand = passes & (layout.depth == deepest[:, None])
    best_joint = torch.where(cand, joint, neg).amax(dim=1)
    cand = cand & (joint == best_joint[:, None])
    choice = cand.to(torch.int32).argmax(dim=1).to(torch.int64)
    return torch.where(cand.any(dim=1), choice, torch.full_like(choice, -1))


def verify_tree(
    batch: TreeBatch,
    node_probs: torch.Tensor,
    *,
    rule: str,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    exp_noise: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    draft_token_probs: torch.Tensor | None = None,
    acceptance_threshold: float = 1.0,
    all_greedy: bool = False,
) -> TreeVerdict:
    """Verify a ragged batch of draft trees in one call. Rules: module docstring.

    ``node_probs`` [T + B, V] (request-major, row 0 = after the root); ``is_greedy`` [B];
    ``uniforms`` [T] one per node; ``exp_noise`` [B, V]; ``target_argmax`` [T + B]
    (default: the rows' first maximum); ``draft_probs`` [T, V] (``"sampled"``: the q row
    each child was drawn from, the same row for siblings, of which the first child's is
    read; ``"mtad"``: a source of ``draft_token_probs``);
    ``draft_token_probs`` [T] (``"mtad"``: each node's q of its token);
    ``acceptance_threshold`` MTAD's tau. ``all_greedy=True`` (every request greedy,
    which the caller knows on the host) skips the sampled work; uniforms, noise and q
    may then be None.
    """
    _check_inputs(batch, node_probs, rule, is_greedy, uniforms, exp_noise, target_argmax,
                  draft_probs, draft_token_probs, acceptance_threshold, all_greedy)
    layout = tree_layout(batch)
    b, d_max = batch.num_requests, layout.max_depth
    dev = node_probs.device
    if target_argmax is None:
        target_argmax = node_probs.argmax(dim=-1)
    target_argmax = target_argmax.to(torch.int64)
    greedy = torch.ones(b, dtype=torch.bool, device=dev) if all_greedy else is_greedy.to(torch.bool)
    ids = batch.token_ids.to(torch.int64)

    walk_rule = None if (all_greedy or rule == "mtad") else rule
    final, r = _walk(layout, ids, node_probs, walk_rule, greedy, target_argmax, uniforms,
                     draft_probs)
    extra = target_argmax.index_select(0, _node_rows(layout, final))
    if not all_greedy:
        assert exp_noise is not None
        if rule == "mtad":
            q_tok = draft_token_probs
            if q_tok is None:
                assert draft_probs is not None
                _, safe = _valid_ids(ids, node_probs.shape[1])
                q_tok = draft_probs.gather(1, safe[:, None]).squeeze(1)
            chosen = _mtad_choice(layout, ids, node_probs, q_tok, acceptance_threshold)
            final = torch.where(greedy, final, chosen)
            dist = node_probs.index_select(0, _node_rows(layout, final)).to(torch.float32)
        else:
            assert r is not None
            dist = r
        extra = torch.where(greedy, extra, _race(dist, exp_noise))

    path = _path_to(final, layout)  # [B, D]
    num_accepted = (path >= 0).sum(dim=1)
    if batch.num_nodes:
        flat = layout.flat.gather(1, path.clamp(min=0)) if d_max else path
        tokens = torch.where(path >= 0, ids.index_select(0, flat.reshape(-1)).view_as(flat),
                             torch.full_like(path, PLACEHOLDER_TOKEN_ID))
    else:
        tokens = torch.full_like(path, PLACEHOLDER_TOKEN_ID)
    out = torch.cat([tokens, tokens.new_full((b, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    cols = torch.arange(d_max + 1, device=dev)[None, :]
    out = torch.where(cols == num_accepted[:, None], extra[:, None].expand_as(out), out)
    return TreeVerdict(output_token_ids=out, accepted_nodes=path, num_accepted=num_accepted)
