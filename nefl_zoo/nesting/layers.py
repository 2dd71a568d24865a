"""What a layer records in the channel analysis (:mod:`.channels`): the id vector of each
dimension of its parameters (:attr:`~.ids.Channels.dims`), the channels its output starts or
passes through, and the groups and statistics that tie channels together."""

from __future__ import annotations

from torch import nn

from .ids import Channels, channel_vector, layer_norm_vector, spread, varies
from .sources import NestError

CHANNEL_NORMS = (nn.GroupNorm, nn.LayerNorm)  # statistics over channels: nest, but not by zeroing


def keep_whole(ch: Channels, m: nn.Module, owner: str, x=None):
    """Every tensor of layer ``m`` stays whole in every tier; returns ``x``."""
    for key, value in [*m.named_parameters(owner), *m.named_buffers(owner)]:
        ch.dims[key] = [None] * value.ndim
    return x


def conv(ch: Channels, params: dict, where: str, owner: str, x, cout: int, groups: int, bias: bool, out_shape,
         wkey: str | None = None):
    """A convolution (weight ``wkey``, default ``{owner}.weight``, in ``params``): a new space of
    ``cout`` output ids; a depthwise or grouped convolution passes its input's ids through
    (whole groups nest). Returns the output's ids."""
    wkey = wkey or f"{owner}.weight"
    vec = channel_vector(x, 1, where, ch, shared=True)
    cin = vec.numel()
    extra = [None] * (params[wkey].ndim - 2)
    if groups == 1:
        out = ch.new(wkey, cout)
        ch.dims[wkey] = [out, vec, *extra]
    elif cout == cin:
        out = vec
        ch.dims[wkey] = [vec, None, *extra]
        ch.quantum.append((vec, cin // groups))
        ch.convs[wkey] = (groups, cin, cout)
    else:  # the channels per group change (a depthwise multiplier, ResNeSt): whole groups nest
        grouped = vec.view(groups, cin // groups)
        ch.union(grouped, grouped[:, :1])
        out = grouped[:, 0].repeat_interleave(cout // groups)
        ch.dims[wkey] = [out, None, *extra]
        ch.convs[wkey] = (groups, cin, cout)
    if bias:
        ch.dims[f"{owner}.bias"] = [out]
    return spread(out, out_shape)


def linear(ch: Channels, where: str, owner: str, x, cout: int, bias: bool, wkey: str | None = None):
    """A linear layer over the last dimension: a new space of ``cout`` output ids. Returns the
    output's ids."""
    wkey = wkey or f"{owner}.weight"
    if not varies(x, x.ndim - 1) and any(varies(x, d) for d in range(x.ndim - 1)):
        # mixing tokens (MLP-Mixer), or one small layer over each channel's value (a last
        # dimension of 1): shared by every channel, which it keeps
        ch.dims[wkey] = [None, None]
        if bias:
            ch.dims[f"{owner}.bias"] = [None]
        return x.narrow(-1, 0, 1).expand(*x.shape[:-1], cout)
    vec = channel_vector(x, x.ndim - 1, where, ch, shared=True)
    out = ch.new(wkey, cout)
    ch.dims[wkey] = [out, vec]
    if bias:
        ch.dims[f"{owner}.bias"] = [out]
    return spread(out, (*x.shape[:-1], cout), x.ndim - 1)


def norm(ch: Channels, where: str, owner: str, m: nn.Module, x):
    """A normalisation layer: its parameters follow the channels they scale; the statistics of
    GroupNorm and LayerNorm (over channels) are recorded. Returns ``x``."""
    if isinstance(m, nn.LayerNorm):
        if len(m.normalized_shape) != 1:
            raise NestError(f"{where}: LayerNorm over {len(m.normalized_shape)} dimensions")
        vec = layer_norm_vector(ch, x, x.ndim - 1, where)
        if vec is None:
            return keep_whole(ch, m, owner, x)
    else:
        vec = channel_vector(x, 1, where, ch)
    if isinstance(m, CHANNEL_NORMS):
        ch.channel_stats.append((where, vec))
    if isinstance(m, nn.GroupNorm):
        ch.quantum.append((vec, m.num_channels // m.num_groups))
        ch.norm_groups[f"{owner}.weight"] = m.num_channels // m.num_groups
    for key, value in list(m.named_parameters(owner)) + list(m.named_buffers(owner)):
        ch.dims[key] = [vec] if value.ndim == 1 else [None] * value.ndim
    return x
