"""Learning-rate / weight-decay schedule: Megatron's constructor, formulas and checkpoint rules.

The schedule is a pure function of ``num_steps`` (iterations, or samples when the training loop
passes the global batch size as the increment). ``step()`` writes the result into every optimizer
param group, scaled by the group's ``lr_mult`` / ``wd_mult``; a group may also carry its own
``max_lr`` / ``min_lr`` / ``start_wd`` / ``end_wd``.

Decay coefficients (``ratio`` in [0, 1], lr = min_lr + coeff * (max_lr - min_lr)):
  linear 1 - r;  cosine 0.5 * (cos(pi * r) + 1);  WSD: 1 until ``lr_decay_steps - wsd_decay_steps``,
  then over the last ``wsd_decay_steps``: linear 1 - r, cosine as above,
  exponential 2 * 0.5**r - 1, minus_sqrt 1 - sqrt(r).
"""

import math

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")

# Old checkpoint key names (Megatron before the iterations -> steps rename), newest last.
_KEY_ALIASES = {
    "max_lr": ("start_lr", "max_lr"),
    "lr_warmup_steps": ("warmup_iter", "warmup_steps", "lr_warmup_steps"),
    "lr_decay_steps": ("end_iter", "decay_steps", "lr_decay_steps"),
    "lr_decay_style": ("decay_style", "lr_decay_style"),
    "num_steps": ("num_iters", "num_steps"),
}

# Flag each field comes from, so errors point at what the user typed.
_FLAGS = {
    "max_lr": "--lr", "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters/--lr-warmup-samples",
    "lr_decay_steps": "--lr-decay-iters/--lr-decay-samples", "lr_decay_style": "--lr-decay-style",
    "wsd_decay_steps": "--lr-wsd-decay-iters/--lr-wsd-decay-samples",
    "lr_wsd_decay_style": "--lr-wsd-decay-style", "start_wd": "--start-weight-decay",
    "end_wd": "--end-weight-decay", "wd_incr_steps": "--train-iters/--train-samples",
    "wd_incr_style": "--weight-decay-incr-style",
}


class OptimizerParamScheduler:
    """Anneals the learning rate and increments the weight decay of ``optimizer.param_groups``."""

    def __init__(self, optimizer, init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps,
                 lr_decay_style, start_wd, end_wd, wd_incr_steps, wd_incr_style,
                 use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False,
                 wsd_decay_steps=None, lr_wsd_decay_style=None):
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.num_steps = 0
        self._validate()
        self.step(0)  # param groups start at the warmup-start lr

    def _validate(self):
        def check(ok, msg):
            if not ok:
                raise ValueError(f"OptimizerParamScheduler: {msg}")

        check(not (self.override_opt_param_scheduler and
                   self.use_checkpoint_opt_param_scheduler),
              "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
              "exclusive; pick one")
        check(self.min_lr >= 0.0, f"--min-lr ({self.min_lr}) must be >= 0")
        check(self.min_lr <= self.max_lr,
              f"--min-lr ({self.min_lr}) must be <= --lr ({self.max_lr})")
        check(0.0 <= self.init_lr <= self.max_lr,
              f"--lr-warmup-init ({self.init_lr}) must be in [0, --lr ({self.max_lr})]")
        check(self.lr_decay_steps > 0,
              f"{_FLAGS['lr_decay_steps']} ({self.lr_decay_steps}) must be > 0")
        check(0 <= self.lr_warmup_steps < self.lr_decay_steps,
              f"{_FLAGS['lr_warmup_steps']} ({self.lr_warmup_steps}) must be >= 0 and < "
              f"{_FLAGS['lr_decay_steps']} ({self.lr_decay_steps})")
        check(self.lr_decay_style in LR_DECAY_STYLES,
              f"--lr-decay-style {self.lr_decay_style!r} is not one of {LR_DECAY_STYLES}")
        if self.lr_decay_style == "WSD":
            check(self.wsd_decay_steps is not None,
                  f"--lr-decay-style WSD needs {_FLAGS['wsd_decay_steps']}")
            check(0 <= self.wsd_decay_steps <= self.lr_decay_steps,
                  f"{_FLAGS['wsd_decay_steps']} ({self.wsd_decay_steps}) must be in "
                  f"[0, {_FLAGS['lr_decay_steps']} ({self.lr_decay_steps})]")
            check(self.lr_wsd_decay_style in WSD_DECAY_STYLES,
                  f"--lr-wsd-decay-style {self.lr_wsd_decay_style!r} is not one of "
                  f"{WSD_DECAY_STYLES}")
        check(self.start_wd >= 0.0 and self.end_wd >= 0.0,
              f"--start-weight-decay ({self.start_wd}) and --end-weight-decay ({self.end_wd}) "
              "must be >= 0")
        check(self.wd_incr_style in WD_INCR_STYLES,
              f"--weight-decay-incr-style {self.wd_incr_style!r} is not one of {WD_INCR_STYLES}")
        if self.wd_incr_style == "constant":
            check(self.start_wd == self.end_wd,
                  f"--weight-decay-incr-style constant needs --start-weight-decay ({self.start_wd})"
                  f" == --end-weight-decay ({self.end_wd}); use --weight-decay for both")
        else:  # the ratio divides by it
            check(self.wd_incr_steps > 0,
                  f"{_FLAGS['wd_incr_steps']} ({self.wd_incr_steps}) must be > 0 for "
                  f"--weight-decay-incr-style {self.wd_incr_style}")

    def get_wd(self, param_group=None):
        """Weight decay at ``num_steps`` (before ``wd_mult``)."""
        group = param_group or {}
        start_wd = group.get("start_wd", self.start_wd)
        end_wd = group.get("end_wd", self.end_wd)
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine: slow start, slow finish
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return start_wd + coeff * (end_wd - start_wd)

    def get_lr(self, param_group=None):
        """Learning rate at ``num_steps`` (before ``lr_mult``)."""
        group = param_group or {}
        max_lr = group.get("max_lr", self.max_lr)
        min_lr = group.get("min_lr", self.min_lr)
        warmup, steps = self.lr_warmup_steps, self.num_steps

        if warmup > 0 and steps <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * steps / warmup
        if self.lr_decay_style == "constant":
            return max_lr
        if steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            # max(.., 1) keeps step 0 / no-warmup finite; floored at min_lr.
            lr = max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(steps, 1))
            return max(min_lr, lr)

        ratio = (steps - warmup) / (self.lr_decay_steps - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable at max_lr, then anneal over the last wsd_decay_steps
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if steps <= anneal_start:
                coeff = 1.0
            else:
                r = (steps - anneal_start) / self.wsd_decay_steps
                style = self.lr_wsd_decay_style
                if style == "linear":
                    coeff = 1.0 - r
                elif style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
                elif style == "exponential":  # 1 at r=0, 0 at r=1
                    coeff = 2.0 * math.pow(0.5, r) - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(r)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment):
        """Advance by ``increment`` steps (or samples) and write lr / weight_decay to the groups."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    _STATE_FIELDS = ("max_lr", "lr_warmup_steps", "lr_decay_style", "lr_decay_steps", "min_lr",
                     "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps", "wsd_decay_steps",
                     "lr_wsd_decay_style")

    def state_dict(self):
        """Plain data only, so checkpoints load with ``weights_only=True``."""
        sd = {name: getattr(self, name) for name in self._STATE_FIELDS}
        sd["num_steps"] = self.num_steps
        return sd

    def _resolve(self, name, ckpt_value):
        cls_value = getattr(self, name)
        if self.override_opt_param_scheduler:
            return cls_value
        if self.use_checkpoint_opt_param_scheduler or cls_value == ckpt_value:
            return ckpt_value
        raise ValueError(
            f"OptimizerParamScheduler: {name} is {cls_value!r} ({_FLAGS[name]}) but the checkpoint "
            f"has {ckpt_value!r}; pass --override-opt_param-scheduler to use the flag values or "
            "--use-checkpoint-opt_param-scheduler to use the checkpoint's")

    def load_state_dict(self, state_dict):
        """Restore ``num_steps`` and the schedule fields under Megatron's override rules."""
        def lookup(name):
            for key in reversed(_KEY_ALIASES.get(name, (name,))):
                if key in state_dict:
                    return True, state_dict[key]
            return False, None

        # Resolve everything before assigning, so a mismatch leaves the scheduler untouched.
        new_values = {}
        for name in self._STATE_FIELDS:
            present, value = lookup(name)
            if present:  # fields missing from old checkpoints keep the class value
                new_values[name] = self._resolve(name, value)
        present, num_steps = lookup("num_steps")
        if not present:
            raise ValueError("OptimizerParamScheduler: checkpoint has no 'num_steps'")
        for name, value in new_values.items():
            setattr(self, name, value)
        self.num_steps = num_steps
        self.step(0)
