"""Random numbers: one global generator per device, all reseeded by `manual_seed` (like
torch.manual_seed), used by the initialisers and dropout."""
from . import backend

_generators = {}


def default_rng(seed=None, device="cpu"):
    """A new random Generator whose arrays live on `device`."""
    xp = backend.module_for(device)
    return xp.random.default_rng(seed)


def manual_seed(seed):
    """Reseed the global generator of every device (like torch.manual_seed)."""
    _generators.clear()
    _generators["seed"] = int(seed)


def global_rng(device="cpu"):
    """The global generator of a device, used by dropout and initialisers."""
    if device not in _generators:
        seed = _generators.get("seed")
        if seed is not None:  # one independent stream per device from the one seed
            seed = int(backend.module_for("cpu").random.SeedSequence([seed, backend.DEVICES.index(device)]).generate_state(1)[0])
        _generators[device] = default_rng(seed, device)
    return _generators[device]
