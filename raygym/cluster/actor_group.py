"""Groups of typed Ray actors placed into probed bundles, with the torchrun environment contract.

Every trainer actor starts with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR (rank 0's
node IP) and MASTER_PORT (a port found free ON rank 0's node), so ``torch.distributed.init_process_group
("gloo" | "nccl")`` with the default ``env://`` init just works. User variables (recipe ``environment``
and ``train_env_vars``) are added but may not override those keys, CUDA_VISIBLE_DEVICES or RAY_*.
Ray sets CUDA_VISIBLE_DEVICES per actor to its bundle's GPU (logical GPUs on a CPU-only machine).

Ray is imported inside functions; the env helpers are pure.

>>> build_rank_envs(["n1", "n1", "n2"], "10.0.0.1", 29500)[2]["LOCAL_RANK"]
'0'
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from raygym.cluster.placement import BundleRecord, Placement
from raygym.errors import ConfigError, RaygymError

logger = logging.getLogger(__name__)

T = TypeVar("T")

TORCHRUN_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RESERVED_ENV_KEYS = frozenset(TORCHRUN_ENV_KEYS + ("GROUP_RANK", "NODE_RANK", "CUDA_VISIBLE_DEVICES"))
RESERVED_ENV_PREFIXES = ("RAY_",)


# ----------------------------------------------------------------------------------------------
# Environment (pure)
# ----------------------------------------------------------------------------------------------


def _as_env_mapping(field_name: str, value: Mapping[str, Any] | str | None) -> dict[str, str]:
    if value is None or value == "":
        return {}
    if isinstance(value, str):  # train_env_vars may be inline JSON
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f'{field_name}={value!r}: not valid JSON ({exc.msg}); pass an object like \'{{"KEY": "v"}}\''
            ) from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{field_name}={value!r}: must be a mapping of variable name to value")
    out = {}
    for key, val in value.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{field_name}: key {key!r} must be a non-empty string")
        out[key] = (
            val if isinstance(val, str) else json.dumps(val) if isinstance(val, (dict, list)) else str(val)
        )
    return out


def check_user_env(field_name: str, env: Mapping[str, str]) -> None:
    """Raise ConfigError when ``env`` sets a key raygym owns (torchrun keys, CUDA_VISIBLE_DEVICES, RAY_*)."""
    for key in env:
        if key in RESERVED_ENV_KEYS or key.startswith(RESERVED_ENV_PREFIXES):
            raise ConfigError(
                f"{field_name}[{key!r}]: {key} is reserved — raygym sets it for every rank (torchrun contract, "
                "Ray's GPU assignment or Ray's own settings); remove it from "
                f"{field_name}"
            )


def merge_user_env(
    environment: Mapping[str, Any] | None = None,
    train_env_vars: Mapping[str, Any] | str | None = None,
) -> dict[str, str]:
    """Recipe ``environment`` overlaid with ``train_env_vars`` (dict or inline JSON), reserved keys refused.

    >>> merge_user_env({"NCCL_DEBUG": "WARN"}, '{"OMP_NUM_THREADS": 1}')
    {'NCCL_DEBUG': 'WARN', 'OMP_NUM_THREADS': '1'}
    """
    env = _as_env_mapping("environment", environment)
    check_user_env("environment", env)
    train = _as_env_mapping("train_env_vars", train_env_vars)
    check_user_env("train_env_vars", train)
    return {**env, **train}


def build_rank_envs(
    node_ids: Sequence[str],
    master_addr: str,
    master_port: int,
    user_env: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """One env per rank (rank = position in ``node_ids``); LOCAL_RANK counts ranks on the same node."""
    user = dict(user_env or {})
    check_user_env("environment", user)
    per_node: dict[str, int] = {}
    local_ranks = []
    for nid in node_ids:
        local_ranks.append(per_node.get(nid, 0))
        per_node[nid] = per_node.get(nid, 0) + 1
    node_rank = {nid: i for i, nid in enumerate(dict.fromkeys(node_ids))}
    world = len(node_ids)
    return [
        {
            **user,
            "RANK": str(rank),
            "LOCAL_RANK": str(local_ranks[rank]),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per_node[nid]),
            "GROUP_RANK": str(node_rank[nid]),
            "NODE_RANK": str(node_rank[nid]),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
        for rank, nid in enumerate(node_ids)
    ]


def shard_evenly(items: Sequence[T], n: int) -> list[list[T]]:
    """Split into ``n`` contiguous shards whose sizes differ by at most one (the first ones larger).

    >>> shard_evenly([1, 2, 3, 4, 5], 2)
    [[1, 2, 3], [4, 5]]
    """
    if n <= 0:
        raise ValueError(f"n={n}: need at least one shard")
    base, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(list(items[start : start + size]))
        start += size
    return out


# ----------------------------------------------------------------------------------------------
# Ray side
# ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def find_free_port_on_node(node_id: str, timeout: float = 60.0) -> int:
    """A TCP port that was free on node ``node_id`` (asked by a zero-CPU task pinned to that node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(_free_port).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    )
    return int(ray.get(task.remote(), timeout=timeout))


_RANK_ENV_KWARG = "_raygym_rank_env"


@functools.cache
def _with_rank_env(actor_cls: type[Any]) -> type[Any]:
    """A subclass of ``actor_cls`` whose __init__ first exports the rank's variables to os.environ.

    Defined here (not importable by name) so cloudpickle ships it by value to the workers.
    """

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        os.environ.update(kwargs.pop(_RANK_ENV_KWARG, None) or {})
        if os.environ.get("MASTER_ADDR"):  # gloo ranks on several nodes must bind the cluster's interface
            from raygym.cluster.netif import pin_gloo_interface

            pin_gloo_interface(os.environ["MASTER_ADDR"])
        actor_cls.__init__(self, *args, **kwargs)

    return type(actor_cls.__name__, (actor_cls,), {"__init__": __init__, "__doc__": actor_cls.__doc__})


@dataclass
class ActorGroup:
    """N Ray actors of one class, actor ``i`` in ``bundles[i]``; ``envs[i]`` is what it was started with.

    >>> group = ActorGroup.start(MyTrainer, placement.actor_bundles, args=(cfg,))   # doctest: +SKIP
    >>> call_all(group, lambda actor: actor.init.remote())                            # doctest: +SKIP
    >>> group.kill()                                                                  # doctest: +SKIP
    """

    handles: list[Any]
    bundles: list[BundleRecord]
    envs: list[dict[str, str]]
    master_addr: str | None = None
    master_port: int | None = None
    killed: bool = field(default=False)

    @property
    def world_size(self) -> int:
        return len(self.handles)

    def __len__(self) -> int:
        return len(self.handles)

    @classmethod
    def start(
        cls,
        actor_cls: type,
        bundles: Sequence[BundleRecord],
        *,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        per_rank_kwargs: Sequence[Mapping[str, Any]] | None = None,
        user_env: Mapping[str, str] | None = None,
        torchrun_env: bool = True,
        gpu_share: float | None = None,
        num_cpus: float = 0.0,
        name_prefix: str = "",
    ) -> ActorGroup:
        """Start one ``actor_cls(*args, **kwargs, **per_rank_kwargs[i])`` per bundle, returning at once.

        ``actor_cls`` is a plain class (wrapped with ``ray.remote`` here; the rank variables are set in
        ``os.environ`` before its ``__init__`` runs) or an already remote class (then every variable
        travels in ``runtime_env``, which starts slower).
        Each actor requests ``gpu_share`` GPUs (default: the bundle's role share) and ``num_cpus``
        inside its bundle. With ``torchrun_env`` the actors get the torchrun variables; the master
        port is found free on rank 0's node.
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not bundles:
            raise RaygymError(
                f"ActorGroup.start({getattr(actor_cls, '__name__', actor_cls)}): no bundles given"
            )
        if per_rank_kwargs is not None and len(per_rank_kwargs) != len(bundles):
            raise ValueError(f"per_rank_kwargs has {len(per_rank_kwargs)} entries for {len(bundles)} bundles")
        user = dict(user_env or {})
        check_user_env("environment", user)
        master_addr = master_port = None
        if torchrun_env:
            master_addr = bundles[0].node_ip
            master_port = find_free_port_on_node(bundles[0].node_id)
            rank_envs = build_rank_envs([b.node_id for b in bundles], master_addr, master_port)
        else:
            rank_envs = [{} for _ in bundles]

        # Per-rank variables are applied inside the actor before its __init__ (torch reads them at
        # init_process_group); a distinct runtime_env per rank would cost Ray a new worker setup each
        # (~2.5x slower starts measured here). The shared user env goes through runtime_env so that
        # variables read at process start (PYTHONPATH, LD_*) take effect.
        plain = not isinstance(actor_cls, ray.actor.ActorClass)
        remote_cls: ray.actor.ActorClass[Any] = (
            actor_cls if isinstance(actor_cls, ray.actor.ActorClass) else ray.remote(_with_rank_env(actor_cls))
        )
        handles = []
        for i, (bundle, rank_env) in enumerate(zip(bundles, rank_envs, strict=True)):
            options: dict[str, Any] = {
                "num_cpus": num_cpus,
                "num_gpus": bundle.gpu_share if gpu_share is None else gpu_share,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=bundle.placement_group, placement_group_bundle_index=bundle.bundle_index
                ),
            }
            process_env = user if plain else {**user, **rank_env}
            if process_env:
                options["runtime_env"] = {"env_vars": process_env}
            if name_prefix:
                options["name"] = f"{name_prefix}-{i}"
            call_kwargs = {
                **(kwargs or {}),
                **(dict(per_rank_kwargs[i]) if per_rank_kwargs is not None else {}),
            }
            if plain:
                call_kwargs[_RANK_ENV_KWARG] = rank_env
            handles.append(remote_cls.options(**options).remote(*args, **call_kwargs))
        envs = [{**user, **r} for r in rank_envs]
        return cls(list(handles), list(bundles), envs, master_addr, master_port)

    def kill(self) -> None:
        """Kill every actor by its handle (idempotent); they do not restart."""
        if self.killed:
            return
        self.killed = True
        import ray

        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception as exc:  # already dead or Ray gone
                logger.debug("ray.kill failed: %s", exc)


def start_trainer_group(
    placement: Placement,
    actor_cls: type,
    *,
    role: str = "actor",
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    environment: Mapping[str, Any] | None = None,
    train_env_vars: Mapping[str, Any] | str | None = None,
) -> ActorGroup:
    """Trainer actors of ``role`` ("actor" | "critic") into their bundles, torchrun env + user env.

    >>> trainers = start_trainer_group(placement, TrainerActor, args=(settings,),         # doctest: +SKIP
    ...                                environment=recipe.environment, train_env_vars=recipe.train_env_vars)
    """
    if role not in ("actor", "critic"):
        raise ValueError(f"role={role!r}: trainer groups are 'actor' or 'critic'")
    user = merge_user_env(environment, train_env_vars)
    return ActorGroup.start(actor_cls, placement.role_bundles(role), args=args, kwargs=kwargs, user_env=user)


def start_engine_group(
    placement: Placement,
    actor_cls: type,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    environment: Mapping[str, Any] | None = None,
) -> ActorGroup:
    """One engine actor per engine, in the first bundle of its GPUs, called as
    ``actor_cls(*args, engine_index=i, gpu_ids=[...], host=node_ip, **kwargs)``.

    The engine's server process must be pointed at ``gpu_ids`` itself (Ray only exposes the first
    bundle's GPU to the actor); the other bundles of the engine stay reserved for it.
    """
    engines = placement.engine_bundles
    firsts = [e[0] for e in engines]
    per_rank = [engine_placement_kwargs(i, e) for i, e in enumerate(engines)]
    return ActorGroup.start(
        actor_cls,
        firsts,
        args=args,
        kwargs=kwargs,
        per_rank_kwargs=per_rank,
        user_env=merge_user_env(environment),
        torchrun_env=False,
    )


def engine_placement_kwargs(index: int, bundles: Sequence[BundleRecord]) -> dict[str, Any]:
    """What engine ``index`` is told about where it runs: its GPUs' ids and its node's IP (the address its
    server binds, reachable from every node)."""
    return {"engine_index": index, "gpu_ids": [b.gpu_id for b in bundles], "host": bundles[0].node_ip}


# A remote call on one actor, written where it is made so that the method is named in code, not in a string:
# ``lambda trainer: trainer.offload.remote()``.
RemoteCall = Callable[[Any], Any]
ShardCall = Callable[[Any, Sequence[Any]], Any]  # (handle, its shard of the items) -> ObjectRef


def submit_all(group: ActorGroup, call: RemoteCall) -> list[Any]:
    """``call`` on every actor; returns the ObjectRefs in rank order."""
    return [call(h) for h in group.handles]


def call_all(group: ActorGroup, call: RemoteCall, *, timeout: float | None = None) -> list[Any]:
    """``call`` on every actor; the results in rank order.

    >>> call_all(group, lambda rank: rank.init.remote())                               # doctest: +SKIP
    """
    import ray

    return ray.get(submit_all(group, call), timeout=timeout)


def call_rank0(group: ActorGroup, call: RemoteCall, *, timeout: float | None = None) -> Any:
    """``call`` on rank 0 only; its result."""
    import ray

    return ray.get(call(group.handles[0]), timeout=timeout)


def scatter_gather(group: ActorGroup, call: ShardCall, items: Sequence[Any], *, timeout: float | None = None
                   ) -> list[Any]:
    """Split ``items`` into contiguous data-parallel shards (rank r gets shard r), ``call(handle, shard)`` on
    every rank, and concatenate the per-item results in order.

    Each rank must return a sequence as long as its shard, so the result lines up with ``items``.
    """
    import ray

    shards = shard_evenly(items, group.world_size)
    results = ray.get([call(h, s) for h, s in zip(group.handles, shards, strict=True)], timeout=timeout)
    out: list[Any] = []
    for rank, (shard, res) in enumerate(zip(shards, results, strict=True)):
        if not isinstance(res, Sequence) or len(res) != len(shard):
            got = len(res) if isinstance(res, Sequence) else type(res).__name__
            raise RaygymError(f"scatter_gather: rank {rank} returned {got} results for {len(shard)} items")
        out.extend(res)
    return out


def shutdown_group(group: ActorGroup, call: RemoteCall | None = None, timeout: float = 30.0) -> None:
    """Optionally ``call`` every actor for a clean exit (``lambda a: a.shutdown.remote()``), then kill them."""
    import ray

    if call is not None and not group.killed:
        try:
            call_all(group, call, timeout=timeout)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            logger.warning("shutdown_group: the exit call failed (%s); killing the actors", exc)
    group.kill()
