"""One process of tests/test_distributed.py: an O2 float16 FSDP train step under
``jax.distributed`` on 127.0.0.1, with ``mpjax.loss_scale``.

    python tests/distributed_worker.py PORT PROCESS_ID OUT_DIR

Two such processes, 2 CPU devices each, make a 4-device mesh. The 2-D kernels are sharded
over it (FSDP), the batch too; each process feeds its own half of the batch. At step 2 the
process with id 1 overflows its half (float16 inf); the gradients' finite check is global, so
both processes skip that step. Each writes its view of the run to OUT_DIR/PROCESS_ID.npz: the
full params after every step (gathered from both processes) and the loss scale's state.
"""

from __future__ import annotations

import os
import sys

STEPS = 4
POISONED_STEP = 2


def main(port: int, process_id: int, out_dir: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):
        pass  # newer JAX: gloo is the CPU default
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=120,
    )
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import mpjax

    policy = mpjax.Policy.from_level("O2", "float16")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    assert jax.device_count() == 4 and jax.process_count() == 2

    def model(params, x):
        h = jax.nn.gelu(x @ params["w1"] + params["b1"])
        return h @ params["w2"]

    rng = np.random.default_rng(0)  # the same params and data in both processes
    params = {
        "w1": rng.normal(size=(16, 32)).astype(np.float32) / 4,
        "b1": np.zeros(32, np.float32),
        "w2": rng.normal(size=(32, 8)).astype(np.float32) / 6,
    }
    fsdp = {k: NamedSharding(mesh, P("data") if v.ndim == 2 else P()) for k, v in params.items()}
    params = {k: jax.device_put(v, fsdp[k]) for k, v in params.items()}
    batch = NamedSharding(mesh, P("data"))
    # The wrap form: a skipped step leaves AdamW's state and the params bit-identical.
    tx = mpjax.loss_scale(optax.adamw(1e-2), scale=mpjax.DynamicLossScale(2.0**10))
    state = tx.init(params)
    forward = mpjax.autocast(model, policy)

    @jax.jit
    def step(params, state, x, y):
        scale = mpjax.get_loss_scale(state)
        loss = lambda p: scale.scale(jnp.mean((forward(p, x).astype(jnp.float32) - y) ** 2))
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    history = []
    for i in range(STEPS):
        local_x = rng.normal(size=(8, 16)).astype(np.float32)  # 8 rows per process
        local_y = rng.normal(size=(8, 8)).astype(np.float32)
        if i == POISONED_STEP and process_id == 1:
            local_x[3] = 6e4  # overflows float16 in the first matmul: inf, then NaN
        x = multihost_utils.host_local_array_to_global_array(local_x, mesh, P("data"))
        y = multihost_utils.host_local_array_to_global_array(local_y, mesh, P("data"))
        assert x.sharding.is_equivalent_to(batch, 2)
        params, state = step(params, state, x, y)
        full = multihost_utils.process_allgather(params, tiled=True)
        metrics = mpjax.loss_scale_metrics(state)
        history.append(
            {
                **{f"{k}_{i}": np.asarray(v) for k, v in full.items()},
                f"finite_{i}": np.asarray(bool(metrics["last_step_finite"])),
                f"scale_{i}": np.asarray(float(metrics["loss_scale"])),
                f"skipped_{i}": np.asarray(int(metrics["skipped_steps"])),
            }
        )
    out = {k: v for h in history for k, v in h.items()}
    np.savez(os.path.join(out_dir, f"{process_id}.npz"), **out)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
