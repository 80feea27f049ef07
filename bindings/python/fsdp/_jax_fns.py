# _jax_fns.py - fsdp.jax's jitted functions, shared by every rank and context (one compile per function
# and layout): the whole-function value_and_grad over the units' imported arrays, the layer-wise forward
# and backward, the loss's grad. Private to fsdp.jax.
import threading


def _jax():
    """The jax module, imported on first use; ImportError that says what needs it otherwise."""
    try:
        import jax  # absolute: the real JAX, not this module
    except ImportError as e:
        raise ImportError(f"fsdp.jax needs JAX (pip install jax): {e}") from e
    return jax


# ---- the jitted functions, shared by every rank (one compile per function and layout) ----

_JIT_CACHE = {}
_JIT_CACHE_MAX = 256
_JIT_LOCK = threading.Lock()


def _cached(key, make):
    with _JIT_LOCK:
        fn = _JIT_CACHE.get(key)
    if fn is None:
        fn = make()
        with _JIT_LOCK:
            if len(_JIT_CACHE) >= _JIT_CACHE_MAX:
                _JIT_CACHE.pop(next(iter(_JIT_CACHE)))
            fn = _JIT_CACHE.setdefault(key, fn)
    return fn


def _unit_leaves(jax, arrays, layout, dtype):
    """Inside jit: a unit's params (in its order) sliced and reshaped out of its imported arrays.
    layout: per param (array index, start, numel, shape); numel 0: zeros (no memory behind it)."""
    out = []
    for a, start, n, shape in layout:
        if n == 0:
            out.append(jax.numpy.zeros(shape, dtype))
        else:
            out.append(jax.lax.slice_in_dim(arrays[a], start, start + n).reshape(shape))
    return out


def _place(treedef, positions, leaves):
    """The pytree a unit's leaves make: its subtree (positions None) or, for the root unit, the whole
    structure with every other unit's leaves None (an empty subtree to JAX)."""
    if positions is None:
        return treedef.unflatten(leaves)
    full = [None] * treedef.num_leaves
    for k, leaf in zip(positions, leaves):
        full[k] = leaf
    return treedef.unflatten(full)


def _whole_fn(loss_fn, has_aux, treedef, leaf_src, layouts, dtype):
    jax = _jax()

    def inner(unit_arrays, scale, args, kwargs):
        per_unit = [_unit_leaves(jax, arrs, lay, dtype) for arrs, lay in zip(unit_arrays, layouts)]
        params = treedef.unflatten([per_unit[u][i] for u, i in leaf_src])

        def scaled(p):
            out = loss_fn(p, *args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return loss * scale.astype(loss.dtype), (loss, aux)
        (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        return loss, aux, tuple(treedef.flatten_up_to(grads))
    return jax.jit(inner)


def _layer_fwd(f, treedef, positions, layout, dtype):
    jax = _jax()

    def inner(arrays, x):
        return f(_place(treedef, positions, _unit_leaves(jax, arrays, layout, dtype)), x)
    return jax.jit(inner)


def _layer_bwd(f, treedef, positions, layout, dtype, want_dx):
    jax = _jax()

    def inner(arrays, x, ct):
        leaves = _unit_leaves(jax, arrays, layout, dtype)
        if want_dx:
            _, vjp = jax.vjp(lambda ls, xx: f(_place(treedef, positions, ls), xx), leaves, x)
            g, dx = vjp(ct)
        else:  # the first unit: no grad for the data
            _, vjp = jax.vjp(lambda ls: f(_place(treedef, positions, ls), x), leaves)
            (g,), dx = vjp(ct), None
        return tuple(g), dx
    return jax.jit(inner)


def _loss_grad_fn(loss_fn):
    jax = _jax()

    def inner(y, scale, args):
        def scaled(yy):
            loss = loss_fn(yy, *args)
            return loss * scale.astype(loss.dtype), loss
        (_, loss), ct = jax.value_and_grad(scaled, has_aux=True)(y)
        return loss, ct
    return jax.jit(inner)
