# ranks.py - run_ranks: N ranks as threads of this process (or one rank per process under mpirun).
import threading

from .core import LocalGroup, launcher_world


def run_ranks(n, fn):
    """Calls fn(rank, group) for rank 0..n-1, each in its own thread on one LocalGroup, and returns
    the results by rank. ctypes releases the GIL during libfsdp calls, so ranks run in parallel.
    If a rank raises, the group is aborted so that the other ranks' collectives fail at once with
    CommError (naming the failed rank and its exception) instead of waiting out timeout_s; all
    threads are joined and the first exception, the failed rank's own, is re-raised.

    Under mpirun or srun (fsdp_launcher: OMPI_COMM_WORLD_*, PMI_*, SLURM_*) this process is one rank: fn(launcher rank,
    None) is called once, and a Context created with group None takes its rank from the launcher.

    Thread ranks share everything process-wide: torch's global RNG (ranks that build a model at once draw
    different inits, with no error: fsdp.torch.shard's sync_module_states, on by default, gives every rank
    rank 0's values), torch's intra-op thread count (torch.set_num_threads(cores // n)), default dtype,
    JAX's runtime, config and jit caches, numpy's global RNG. Processes (mpirun) share none of it.
    docs/bindings.md, "PyTorch" and "JAX"."""
    lw = launcher_world()
    if lw is not None:
        return [fn(lw[0], None)]
    results, errors = [None] * n, []
    lock = threading.Lock()
    with LocalGroup(n) as group:
        def body(rank):
            try:
                results[rank] = fn(rank, group)
            except BaseException as e:  # noqa: B902 - re-raised in the caller's thread
                with lock:
                    errors.append(e)
                    first = len(errors) == 1
                if first:
                    group.abort(f"rank {rank} raised {type(e).__name__}: {e}")

        threads = [threading.Thread(target=body, args=(r,), name=f"fsdp-rank{r}", daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return results
