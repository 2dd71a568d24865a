"""Depth: residual blocks whose branch is added to an identity shortcut (``y = x + F(x)``).

Such a block gets a learnable step size (``y = x + s * F(x)``) and can be removed (``s = 0``:
``y = x``). A residual add whose other input is not the block's input (a projection
shortcut), or whose branch feeds anything else, cannot be skipped and is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .channels import UNARY, op_name

PASS_MODULES = (nn.Identity, nn.Dropout)
ADDS = {"add", "iadd", "add_"}


@dataclass
class Block:
    """One skippable block: the add node, its branch and shortcut inputs, where its step lives."""

    add: str  # node names
    branch_out: str
    shortcut: str
    branch: frozenset[str]
    owner: str  # module path of the block (its step is ``{owner}.{step}``)
    step: str
    stage: int = 0
    index: int = 0


def _passthrough(gm, n):
    """The node ``n`` forwards unchanged (identity, dropout, stochastic depth), or ``None``."""
    if n.op == "call_module" and isinstance(gm.get_submodule(n.target), PASS_MODULES):
        return n.args[0]
    if n.op in ("call_function", "call_method") and op_name(n) in UNARY & {"dropout", "stochastic_depth", "contiguous", "clone"}:
        return n.args[0]
    return None


def _reachable(n, neighbours) -> set:
    """Every node reached from ``n`` by repeatedly following ``neighbours(node)``."""
    seen, todo = set(), [n]
    while todo:
        for a in neighbours(todo.pop()):
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def _ancestors(n) -> set:
    return _reachable(n, lambda x: x.all_input_nodes)


def _descendants(n) -> set:
    return _reachable(n, lambda x: x.users)


def _owner(n) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def is_parameter(module: nn.Module, key: str) -> bool:
    """Whether ``key`` names a parameter of ``module`` (not a buffer or a plain tensor)."""
    try:
        module.get_parameter(key)
    except AttributeError:
        return False
    return True


def _has_params(gm, nodes) -> bool:
    for n in nodes:
        if n.op == "get_attr" and is_parameter(gm, n.target):
            return True
        if n.op == "call_module" and any(True for _ in gm.get_submodule(n.target).parameters()):
            return True
    return False


# why a residual add is no block, in the order _as_block checks: a later reason got further
NOT_BLOCK = ("its shortcut is not the block's input (a projection shortcut)", "its branch has no parameters",
             "its branch feeds other nodes", "its inputs have different shapes")


def _as_block(gm, add, u, v) -> Block | str:
    """``add = u + v`` as a block with branch ``u`` and identity shortcut ``v``, or why not."""
    root = v
    while (nxt := _passthrough(gm, root)) is not None:
        root = nxt
    anc = _ancestors(u) | {u}
    if root not in anc:
        return NOT_BLOCK[0]
    branch = (anc & _descendants(root)) - {root}
    branch |= {a for b in branch for a in b.all_input_nodes if a.op == "get_attr"}  # what it reads directly (a layer scale)
    if not _has_params(gm, branch):
        return NOT_BLOCK[1]
    if any(user not in branch and user is not add for b in branch for user in b.users):
        return NOT_BLOCK[2]
    shapes = {x.meta.get("nest_shape") for x in (u, v, add)}
    if len(shapes) != 1:
        return NOT_BLOCK[3]
    return Block(add.name, u.name, v.name, frozenset(b.name for b in branch), _owner(add), "step")


def find_blocks(gm, img_size: int) -> tuple[list[Block], list[str], list[str], list[int]]:
    """Skippable blocks (with stage and index), unskippable residual adds, stage modules and
    reductions. A stage is a run of blocks at one resolution."""
    blocks, unskippable = [], []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or op_name(n) not in ADDS:
            continue
        args = [a for a in n.args[:2] if hasattr(a, "op") and a.op != "get_attr"]
        if len(args) != 2:
            continue
        found = [_as_block(gm, n, u, v) for u, v in (args, args[::-1])]
        block = next((b for b in found if isinstance(b, Block)), None)
        if block is None:
            if n.meta.get("nest_shape") and len(n.meta["nest_shape"]) >= 3:
                unskippable.append(f"{_owner(n) or n.name}: {max(found, key=NOT_BLOCK.index)}")  # the order that got further
            continue
        blocks.append(block)
    names = {}
    stage_modules, reductions = [], []
    last = None
    for b in blocks:
        names[b.owner] = names.get(b.owner, -1) + 1
        if names[b.owner]:
            b.step = f"step_{names[b.owner]}"
        shape = next(n for n in gm.graph.nodes if n.name == b.add).meta["nest_shape"]
        reduction = max(1, img_size // shape[-1]) if len(shape) == 4 else 1
        if reduction != last:
            stage_modules.append(b.owner.rpartition(".")[0] or b.owner)
            reductions.append(reduction)
            last = reduction
        else:
            stage_modules[-1] = _common(stage_modules[-1], b.owner.rpartition(".")[0] or b.owner)
        b.stage, b.index = len(stage_modules) - 1, sum(1 for o in blocks[: blocks.index(b)] if o.stage == len(stage_modules) - 1)
    return blocks, unskippable, stage_modules, reductions


def _common(a: str, b: str) -> str:
    pa, pb = a.split("."), b.split(".")
    out = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        out.append(x)
    return ".".join(out)
