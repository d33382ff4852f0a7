"""A weight-update peer that is not raygym's code, run as its own process:

- ``--impl sglang``: SGLang's own ``sglang.srt.utils.init_custom_process_group`` (run it with the SGLang
  interpreter);
- ``--impl written``: the same rendezvous written here from SGLang's source (TCP store, keys namespaced by
  ``PrefixStore(group_name, ...)``, a named group, ranks mapped for ``torch.distributed.broadcast``);
- ``--impl unprefixed``: that rendezvous without the key prefix (what raygym's sender did before).

It receives (or sends) one float32 tensor of ``--numel`` elements by broadcast from rank 0 and prints
``{"received": [...]}`` or ``{"sent": true}`` as JSON. Only torch is imported, plus SGLang for ``--impl sglang``.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.distributed as dist


def written_group(url: str, rank: int, world: int, name: str, prefix: bool, timeout_s: float):
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(rendezvous(url, rank, world, timeout=timeout))
    store.set_timeout(timeout)
    if prefix:
        store = PrefixStore(name, store)
    pg, _ = _new_process_group_helper(world, rank, [], dist.Backend("gloo"), store, group_name=name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["sglang", "written", "unprefixed"], required=True)
    p.add_argument("--role", choices=["send", "recv"], required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--group", default="weight_update_group")
    p.add_argument("--numel", type=int, default=8)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args()
    url = f"tcp://127.0.0.1:{a.port}"
    if a.impl == "sglang":
        from sglang.srt.utils import init_custom_process_group

        pg = init_custom_process_group(backend="gloo", init_method=url, world_size=a.world, rank=a.rank,
                                       group_name=a.group, timeout=datetime.timedelta(seconds=a.timeout))
    else:
        pg = written_group(url, a.rank, a.world, a.group, a.impl == "written", a.timeout)
    tensor = torch.arange(a.numel, dtype=torch.float32) * 0.5 if a.role == "send" else torch.zeros(a.numel)
    dist.broadcast(tensor, src=0, group=pg)
    # leave the group before the interpreter exits: a gloo group torn down at exit can abort the process
    # ("terminate called without an active exception") while its peer is still connected
    dist.destroy_process_group(pg)
    print(json.dumps({"sent": True} if a.role == "send" else {"received": tensor.tolist()}), flush=True)


if __name__ == "__main__":
    main()
