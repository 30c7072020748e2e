"""Launcher of adam.cu: Adam's update (the kernel table npformer.functional.adam.adam_update) on a
GPU, one kernel per parameter instead of ~13 array operations."""
from ..cuda import contiguous_floats, entry_grid, function, null
from . import adam_update

THREADS = 256
VARIANTS = {"plain": 0, "l2": 1, "decoupled": 2}  # ADAM_PLAIN, ADAM_L2, ADAM_DECOUPLED in adam.cu


@adam_update.register("cuda", supports=lambda xp, param, grad, exp_avg, exp_avg_sq, scratch, settings, replayed=None:
                      contiguous_floats(param, grad, exp_avg, exp_avg_sq))
def adam_update_cuda(xp, param, grad, exp_avg, exp_avg_sq, scratch, settings, replayed=None):
    if param.size:
        s = settings
        function("adam", "adam_step", param.dtype)(
            (entry_grid(param.size, THREADS),), (THREADS,),
            (param, grad, exp_avg, exp_avg_sq, null(replayed), float(s.step_size), float(s.bias_correction2_sqrt),
             float(s.decay), float(s.one_minus_beta1), float(s.beta2), float(s.one_minus_beta2), float(s.eps),
             float(s.weight_decay), xp.int32(VARIANTS[s.variant]), xp.int64(param.size)))
