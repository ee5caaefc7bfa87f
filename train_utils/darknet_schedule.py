"""Darknet's learning rate, weight update and EMA (AlexeyAB/darknet ``src/network.c``
``get_current_rate``, ``update_network`` with ``update_convolutional_layer``, and the EMA of
``train_network_waitkey``), for training a cfg as Darknet does.

An iteration is one update: ``subdivisions`` forward/backward passes of ``batch / subdivisions``
images each, their gradients summed, then one :meth:`DarknetSGD.step`. Darknet counts images
(``*net.seen``); its iteration number is ``seen / batch``, and the rate of an update is taken
after that iteration's images are counted, so update ``k`` (from 1) uses :func:`current_rate`
at ``k``. :func:`train_utils.engine.train_darknet_iterations` is the loop that drives them.
tests/train_utils/test_darknet_schedule.py checks the rates of every policy and three updates
against the built Darknet.

Values are rounded to float32 where Darknet keeps a C ``float`` and computed in double where it
calls ``pow``/``exp``/``cos``, so the rates equal Darknet's to the last bit.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from build_utils.parse_config import Block, c_float, c_floats, layer_error, to_c_float

POLICIES = ("constant", "step", "steps", "exp", "poly", "random", "sigmoid", "sgdr")
# [net] values that train backwards or blow up, which Darknet would use as they are: (lowest,
# highest) and why; the default recipe's hyp.yaml bounds lr0, momentum and weight_decay alike.
REAL_RANGES = {
    "learning_rate": (0.0, math.inf, "a negative rate climbs the loss"),
    "scales": (0.0, math.inf, "a negative factor makes the rate negative"),
    "momentum": (0.0, 1.0, "the share of the previous update kept"),
    "decay": (0.0, 1.0, "the weight decay per image"),
}
# EMA: Darknet starts averaging at max_batches / 2 and writes the average into the weights
# this many iterations before the end (train_network_waitkey).
EMA_APPLY_BEFORE_END = 1000
RAND_MAX = 2**31 - 1  # glibc's
SGDR_PI = 3.14159265  # the constant get_current_rate writes (not math.pi)


f32 = np.float32


def _c_pow(base: float, exponent: float) -> float:
    """C's ``pow``: NaN for a negative base and a non-integer exponent (Python would make a
    complex number or raise)."""
    try:
        return math.pow(base, exponent)
    except ValueError:
        return math.nan
    except OverflowError:
        return math.inf


def _c_exp(x: float) -> float:
    """C's ``exp``: inf where it overflows (Python raises), so that ``policy=sigmoid``'s rate
    falls to 0 long after its ``step``, as Darknet's does, instead of ending the run."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class DarknetSettings:
    """The ``[net]`` keys of Darknet's training, with its defaults (``parse_net_options``).

    ``batch`` is the cfg's (images per update); Darknet trains ``batch // subdivisions`` images
    per pass, so an update sums :attr:`update_batch` images.
    """

    batch: int = 1
    subdivisions: int = 1
    learning_rate: float = to_c_float(0.001)
    learning_rate_min: float = to_c_float(0.00001)
    momentum: float = to_c_float(0.9)
    decay: float = to_c_float(0.0001)
    max_batches: int = 0
    burn_in: int = 0
    power: float = 4.0
    policy: str = "constant"
    steps: tuple[int, ...] = ()
    scales: tuple[float, ...] = ()
    step: int = 1
    scale: float = 1.0
    gamma: float = 1.0
    sgdr_cycle: int = 0
    sgdr_mult: int = 2
    ema_alpha: float = 0.0

    @property
    def mini_batch(self) -> int:
        """Images per forward pass (Darknet's ``net.batch`` after parsing)."""
        return self.batch // self.subdivisions

    @property
    def update_batch(self) -> int:
        """Images summed into one update (``net.batch * net.subdivisions``): ``batch`` rounded
        down to a multiple of ``subdivisions``."""
        return self.mini_batch * self.subdivisions

    def for_gpus(self, gpus: int) -> DarknetSettings:
        """The settings of one of ``gpus`` processes: Darknet's ``train_detector`` multiplies
        ``learning_rate`` by the number of GPUs (each trains ``batch`` images an iteration and
        the weights are averaged; with DDP's averaged gradients, this rate gives the same
        update as weights averaged every iteration)."""
        return replace(self, learning_rate=float(f32(self.learning_rate) * f32(gpus)))

    @classmethod
    def from_block(cls, net: Block) -> DarknetSettings:
        """The settings of a parsed ``[net]`` block.

        Raises:
            ConfigError: naming the key's line, where Darknet would silently do something else
                or never return: an unknown policy (Darknet: constant), steps without scales or
                decreasing steps for ``steps``, a batch smaller than subdivisions, an sgdr cycle
                that never grows, ``policy=step`` with ``step`` below 1 (Darknet divides by it);
                a value beyond float32 or outside :data:`REAL_RANGES` (a negative rate or scale,
                a momentum above 1: Darknet would train on, backwards or to inf).
        """
        policy = net.get("policy", cls.policy)
        if policy not in POLICIES:
            raise layer_error(net, f"policy={policy} is not one of {', '.join(POLICIES)}", "policy")
        # Every integer key with the field's default: one copy (the field types are strings
        # here: annotations are postponed); sgdr_cycle's default is max_batches, as in Darknet.
        ints = {f.name: int(net.get(f.name, f.default)) for f in fields(cls) if f.type == "int"}
        ints["sgdr_cycle"] = int(net.get("sgdr_cycle", ints["max_batches"]))
        batch, subdivisions = ints["batch"], ints["subdivisions"]
        if subdivisions < 1:
            raise layer_error(
                net, f"subdivisions={subdivisions} must be at least 1", "subdivisions"
            )
        if batch < subdivisions:
            raise layer_error(
                net,
                f"batch={batch} must be at least subdivisions={subdivisions} (each pass trains "
                "batch / subdivisions images)",
                "batch",
            )
        steps = tuple(int(s) for s in net.get("steps", ()))  # Darknet's atoi
        scales = c_floats(net, "scales")
        if policy == "steps":
            if not steps or not scales:
                raise layer_error(net, "policy=steps needs steps= and scales=", "policy")
            if len(scales) < len(steps):
                raise layer_error(
                    net,
                    f"scales lists {len(scales)} values for {len(steps)} steps",
                    "scales",
                )
            _check_steps_increase(net, steps)
        sgdr_cycle, sgdr_mult = ints["sgdr_cycle"], ints["sgdr_mult"]
        if policy == "sgdr" and (sgdr_cycle < 1 or sgdr_mult < 1):
            raise layer_error(
                net,
                f"policy=sgdr needs sgdr_cycle >= 1 (default: max_batches) and sgdr_mult >= 1, "
                f"got {sgdr_cycle} and {sgdr_mult}",
                "sgdr_cycle" if sgdr_cycle < 1 else "sgdr_mult",
            )
        if ints["burn_in"] < 0:  # max_batches: the recipe's one range check (darknet_recipe)
            raise layer_error(net, f"burn_in={ints['burn_in']} must be at least 0", "burn_in")
        # The float keys likewise, as Darknet reads them (float32).
        reals = {f.name: c_float(net, f.name, f.default) for f in fields(cls) if f.type == "float"}
        _check_reals(net, reals, scales)
        if policy == "step" and ints["step"] < 1:
            raise layer_error(
                net, f"policy=step needs step >= 1 (the period), got {ints['step']}", "step"
            )
        ema_alpha = reals["ema_alpha"]
        if not 0 <= ema_alpha < 1:
            raise layer_error(net, f"ema_alpha={ema_alpha} must be in [0, 1)", "ema_alpha")
        return cls(policy=policy, steps=steps, scales=scales, **ints, **reals)


def _check_steps_increase(net: Block, steps: tuple[int, ...]) -> None:
    """Darknet stops at the first step beyond the iteration: a smaller one after it would wait
    for it. Raises ConfigError naming the ``steps`` line."""
    down = next((b for a, b in itertools.pairwise(steps) if b < a), None)
    if down is not None:
        raise layer_error(
            net, f"steps must not decrease: {down} comes after a larger step", "steps"
        )


def _check_reals(net: Block, reals: Mapping[str, float], scales: tuple[float, ...]) -> None:
    """The float keys (as float32) and ``scales`` within :data:`REAL_RANGES`. Raises
    ConfigError naming the key's line."""
    for key, (lo, hi, why) in REAL_RANGES.items():
        values = scales if key == "scales" else (reals[key],)
        bad = [v for v in values if not lo <= v <= hi]
        if bad:
            within = f"at least {lo:g}" if hi == math.inf else f"in [{lo:g}, {hi:g}]"
            raise layer_error(net, f"{key}={bad[0]:g} must be {within} ({why})", key)


class GlibcRandom:
    """glibc's ``rand()`` after ``srand(seed)`` (the TYPE_3 additive feedback generator), so
    that ``policy=random`` can be compared with a Darknet run seeded the same way. Darknet
    itself seeds with the time, so its own runs cannot be repeated."""

    def __init__(self, seed: int = 1):
        word = seed & 0xFFFFFFFF or 1  # srand(0) is srand(1)
        word = word - 2**32 if word >= 2**31 else word  # glibc keeps it in an int32_t
        r = [word]
        for _ in range(1, 31):
            # 16807 * word mod (2**31 - 1) without overflow (Schrage), C's truncating division.
            hi = int(word / 127773)
            lo = word - hi * 127773
            word = 16807 * lo - 2836 * hi
            if word < 0:
                word += 2147483647
            r.append(word)
        r += r[0:3]
        self._r = [v & 0xFFFFFFFF for v in r]
        for _ in range(34, 344):  # glibc discards the first 310 outputs
            self._next_word()

    def _next_word(self) -> int:
        r = self._r
        value = (r[-31] + r[-3]) & 0xFFFFFFFF
        r.append(value)
        del r[0]
        return value

    def rand(self) -> int:
        """The next ``rand()``: 0 .. RAND_MAX."""
        return self._next_word() >> 1


def current_rate(
    settings: DarknetSettings, batch_num: int, rand: Callable[[], int] | None = None
) -> float:
    """Darknet's ``get_current_rate`` at iteration ``batch_num`` (``seen / batch``).

    Args:
        settings: the cfg's ``[net]`` settings.
        batch_num: iterations done, counting the one being updated (the first update uses 1).
        rand: ``rand()`` for ``policy=random`` (default: Python's ``random``, uniform on
            0..RAND_MAX); :class:`GlibcRandom` repeats a seeded Darknet.

    Returns:
        The rate as Darknet's float (float32-exact).
    """
    s = settings
    lr = s.learning_rate
    if batch_num < s.burn_in:
        ratio = float(f32(batch_num) / f32(s.burn_in))
        return to_c_float(lr * _c_pow(ratio, s.power))
    if s.policy == "constant":
        return lr
    if s.policy == "step":
        return to_c_float(lr * _c_pow(s.scale, batch_num // s.step))
    if s.policy == "steps":
        rate = f32(lr)
        for step, scale in zip(s.steps, s.scales):
            if step > batch_num:
                break
            rate = f32(rate * f32(scale))
        return float(rate)
    if s.policy == "exp":
        return to_c_float(lr * _c_pow(s.gamma, batch_num))
    if s.policy == "poly":
        base = float(f32(1) - f32(batch_num) / f32(s.max_batches))
        return to_c_float(lr * _c_pow(base, s.power))
    if s.policy == "random":
        draw = rand() if rand is not None else random.randint(0, RAND_MAX)
        uniform = to_c_float(f32(draw) / f32(RAND_MAX))  # Darknet's rand_uniform(0, 1)
        return to_c_float(lr * _c_pow(uniform, s.power))
    if s.policy == "sigmoid":
        exponent = float(f32(s.gamma) * f32(batch_num - s.step))
        return to_c_float(lr * (1.0 / (1.0 + _c_exp(exponent))))
    # sgdr
    start, cycle = 0, s.sgdr_cycle
    while start + cycle < batch_num:
        start += cycle
        cycle *= s.sgdr_mult
    span = float(f32(lr) - f32(s.learning_rate_min))
    angle = float(f32(batch_num - start)) * SGDR_PI / cycle
    return to_c_float(s.learning_rate_min + 0.5 * span * (1.0 + math.cos(angle)))


# ---------------------------------------------------------------------------------------------
# Update


def darknet_param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The model's parameters as :class:`DarknetSGD` wants them: the weights Darknet decays
    (convolution kernels; the per-input weights of a weighted ``[shortcut]``, which Darknet's
    CPU update decays too) and the rest (conv biases, BatchNorm scales and shifts)."""
    decayed, plain = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            is_kernel = isinstance(module, nn.Conv2d) and name == "weight"
            is_shortcut = not isinstance(module, (nn.Conv2d, nn.modules.batchnorm._BatchNorm))
            (decayed if is_kernel or is_shortcut else plain).append(p)
    groups = [
        {"params": decayed, "decay": True, "name": "weights"},
        {"params": plain, "decay": False, "name": "biases_and_scales"},
    ]
    return [g for g in groups if g["params"]]


class DarknetSGD(torch.optim.Optimizer):
    """Darknet's weight update (``update_convolutional_layer``): per parameter ``w`` with
    gradient ``g`` (summed over the update's images) and buffer ``u``::

        u = u - g                        # Darknet's weight_updates += delta * input
        u = u - decay * batch * w        # decayed groups only
        w = w + rate / batch * u
        u = momentum * u

    ``batch`` is :attr:`DarknetSettings.update_batch`. Parameter groups say ``decay`` (bool);
    :func:`darknet_param_groups` makes them. Parameters without a gradient are left alone
    (Darknet skips layers that do not train). The rate is set per update by :meth:`set_rate`.
    """

    def __init__(
        self, params: Iterable[Any], rate: float, momentum: float, decay: float, batch: int
    ):
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        defaults = {"lr": rate, "momentum": momentum, "decay_rate": decay, "batch": batch}
        super().__init__(params, defaults)

    @classmethod
    def for_model(cls, model: nn.Module, settings: DarknetSettings) -> DarknetSGD:
        """The optimizer of ``model`` with the cfg's momentum, decay and batch."""
        return cls(
            darknet_param_groups(model),
            rate=current_rate(settings, 0),
            momentum=settings.momentum,
            decay=settings.decay,
            batch=settings.update_batch,
        )

    def set_rate(self, rate: float) -> None:
        for group in self.param_groups:
            group["lr"] = rate

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            batch = group["batch"]
            decay_alpha = to_c_float(-group["decay_rate"] * batch) if group.get("decay") else 0.0
            step_alpha = to_c_float(np.float32(group["lr"]) / np.float32(batch))
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                u = state.get("weight_updates")
                if u is None:
                    u = state["weight_updates"] = torch.zeros_like(p)
                u.sub_(p.grad)
                if decay_alpha:
                    u.add_(p, alpha=decay_alpha)
                p.add_(u, alpha=step_alpha)
                u.mul_(momentum)
        return loss


# ---------------------------------------------------------------------------------------------
# EMA


class DarknetEMA:
    """Darknet's EMA (``ema_alpha`` in ``[net]``; ``train_network_waitkey``, CPU and GPU
    builds alike): from iteration ``max_batches // 2`` on, after each update
    ``ema = alpha * ema + (1 - alpha) * w`` (the first time ``ema = w``), until iteration
    ``max_batches - 1000``, where the averages are written into the model and averaging stops.

    Darknet averages what its convolutional layers train: kernels, biases, BatchNorm scales and
    shifts (its conv ``biases`` when there is BatchNorm), never the running statistics nor other
    layers' weights. :attr:`shadow` (``{parameter name: tensor}``) holds the averages; Darknet
    saves them as ``*_ema.weights`` beside ``*_last.weights``.
    """

    def __init__(self, alpha: float, max_batches: int):
        self.alpha = to_c_float(alpha)
        self.start = max_batches // 2
        self.apply_at = max_batches - EMA_APPLY_BEFORE_END
        self.shadow: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def update(self, model: nn.Module, iteration: int) -> None:
        """After the update of ``iteration`` (Darknet's ``cur_iteration``, from 1)."""
        if not self.alpha or iteration < self.start:
            return
        params = _conv_parameters(model)
        if not self.shadow:
            self.shadow = {k: p.detach().clone() for k, p in params.items()}
        if iteration == self.apply_at:
            for k, p in params.items():
                p.copy_(self.shadow[k])
        elif iteration < self.apply_at:
            for k, p in params.items():
                self.shadow[k].mul_(self.alpha).add_(p, alpha=to_c_float(1 - self.alpha))

    def state_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "start": self.start,
            "apply_at": self.apply_at,
            "shadow": dict(self.shadow),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.alpha, self.start, self.apply_at = state["alpha"], state["start"], state["apply_at"]
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}


def _conv_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: parameter}`` of the model's convolutions and BatchNorms (Darknet's
    convolutional layers)."""
    kinds = (nn.Conv2d, nn.modules.batchnorm._BatchNorm)
    return {
        f"{m_name}.{p_name}" if m_name else p_name: p
        for m_name, module in model.named_modules()
        if isinstance(module, kinds)
        for p_name, p in module.named_parameters(recurse=False)
    }
