# The grading guard: the program the grader runs inside every graded kernel, before any
# student code.  It is a module so that it is linted and compiled like any other, but it is
# never imported to be used: grading/guard.py reads this file as text, puts in a fresh key
# (the placeholder below) and grading/execute.py sends it into the kernel.  Importing it only
# defines a function; the last lines run it as the kernel's __main__.  What it does and why:
# grading/guard.py.
#
# Everything lives inside one function, so the kernel's namespace gains nothing but the
# module "_disttrain_grading_guard" in sys.modules: before_test, after_test and record.


def _disttrain_install_guard():
    import builtins
    import importlib
    import sys
    import types

    guard = types.ModuleType("_disttrain_grading_guard")
    try:
        from disttrain_lab.trace import genuine_of as unwrap
    except ImportError:
        unwrap = lambda obj: obj

    def fingerprint(obj):
        f = getattr(obj, "__func__", obj)
        return (
            obj,
            getattr(f, "__code__", None),
            getattr(f, "__defaults__", None),
            dict(getattr(f, "__kwdefaults__", None) or {}),
        )

    def restore_code(obj, fp):
        f = getattr(obj, "__func__", obj)
        f.__code__, f.__defaults__, f.__kwdefaults__ = fp[1], fp[2], fp[3] or None

    def changed_code(obj, fp):
        f = getattr(obj, "__func__", obj)
        return fp[1] is not None and (
            getattr(f, "__code__", None) is not fp[1]
            or getattr(f, "__defaults__", None) != fp[2]
            or dict(getattr(f, "__kwdefaults__", None) or {}) != fp[3]
        )

    functions, modules, instructor = {}, {}, {}
    aliases = {
        "torch": "torch",
        "dist": "torch.distributed",
        "dl": "disttrain_lab",
        "checks": "disttrain_lab.checks",
        "nn": "torch.nn",
        "F": "torch.nn.functional",
        "np": "numpy",
        "os": "os",
        "time": "time",
        "math": "math",
        "sys": "sys",
    }

    submodules, classes = {}, {}

    def is_method(value):
        return isinstance(value, (types.FunctionType, staticmethod, classmethod, property))

    def watch(module, functions_too=True):
        modules[module.__name__] = module
        if module.__name__.startswith("disttrain_lab"):
            for name, obj in list(vars(module).items()):
                if isinstance(obj, types.ModuleType):  # e.g. launcher.tracer: the module it calls
                    submodules[(module.__name__, name)] = obj
                elif isinstance(obj, type) and obj.__module__ == module.__name__:  # e.g. Run.bytes_sent
                    classes[(module.__name__, name)] = (
                        obj,
                        {a: (v, getattr(v, "__code__", None)) for a, v in vars(obj).items() if is_method(v)},
                    )
        if functions_too:
            for name, obj in list(vars(module).items()):
                if not name.startswith("_") and callable(obj) and not isinstance(obj, type):
                    functions[(module.__name__, name)] = fingerprint(unwrap(obj))

    for name in ("os", "time", "math", "sys"):
        watch(importlib.import_module(name), functions_too=False)
    try:
        import torch
        import torch.distributed
        import torch.nn
        import torch.nn.functional
        import torch.testing

        watch(torch, functions_too=False)
        watch(torch.nn, functions_too=False)
        watch(torch.nn.functional, functions_too=False)
        watch(torch.distributed)
        watch(torch.testing)
        for name in ("equal", "allclose", "isclose"):
            functions[("torch", name)] = fingerprint(getattr(torch, name))
    except Exception:
        pass
    if "numpy" in sys.modules:
        watch(sys.modules["numpy"], functions_too=False)
    try:
        import disttrain_lab  # noqa: F401  (loads the kit; the loop below watches its modules)

        for sub in ("checks", "launcher", "devices", "pool", "worker", "trace", "network", "emulation", "integrity"):
            try:
                importlib.import_module("disttrain_lab." + sub)
            except Exception:
                pass
        for modname, module in list(sys.modules.items()):
            if modname.startswith("disttrain_lab") and module is not None and modname != "disttrain_lab.grading":
                watch(module)
    except Exception:
        pass

    # the point-to-point bytes every traced launch's events claim (gloo only: NCCL's bytes
    # do not cross the network the grader counts)
    traffic, ledger = [0], None
    try:
        from disttrain_lab import trace as trace_module

        claimed, observers = trace_module.p2p_bytes_claimed, trace_module._RUN_OBSERVERS

        def observe(run):
            if getattr(run, "backend", None) == "gloo":
                traffic[0] += claimed(run.events)

        observers.append(observe)
        ledger = (trace_module, observers, observe)
    except Exception:
        pass

    shell = get_ipython()  # noqa: F821  (the kernel's IPython shell)
    tm = shell.input_transformer_manager
    events = shell.events.callbacks
    plain = shell.display_formatter.formatters["text/plain"]
    hooks = {
        "custom exception handler (set_custom_exc)": (
            lambda: shell.custom_exceptions,
            lambda v: setattr(shell, "custom_exceptions", v),
        ),
        "CustomTB": (lambda: shell.__dict__.get("CustomTB"), lambda v: setattr(shell, "CustomTB", v)),
        "AST transformers": (
            lambda: list(shell.ast_transformers),
            lambda v: setattr(shell, "ast_transformers", list(v)),
        ),
        "input transformers": (
            lambda: list(shell.input_transformers_post),
            lambda v: setattr(shell, "input_transformers_post", list(v)),
        ),
        "input cleanup transforms": (
            lambda: list(tm.cleanup_transforms),
            lambda v: setattr(tm, "cleanup_transforms", list(v)),
        ),
        "input line transforms": (lambda: list(tm.line_transforms), lambda v: setattr(tm, "line_transforms", list(v))),
        "input token transformers": (
            lambda: list(tm.token_transformers),
            lambda v: setattr(tm, "token_transformers", list(v)),
        ),
        "the input transformer manager": (
            lambda: shell.input_transformer_manager,
            lambda v: setattr(shell, "input_transformer_manager", v),
        ),
        "events callbacks": (
            lambda: {k: list(v) for k, v in events.items()},
            lambda v: [events.__setitem__(k, list(cbs)) for k, cbs in v.items()],
        ),
        "the events manager": (lambda: shell.events, lambda v: setattr(shell, "events", v)),
        # (sys.displayhook, sys.excepthook and builtins.get_ipython are set and put back
        # around every cell by IPython itself; the shell's own hooks are what persists)
        "display hook": (lambda: shell.displayhook, lambda v: setattr(shell, "displayhook", v)),
        "the display publisher": (lambda: shell.display_pub, lambda v: setattr(shell, "display_pub", v)),
        "a trace/profile function": (
            lambda: (sys.gettrace(), sys.getprofile()),
            lambda v: (sys.settrace(v[0]), sys.setprofile(v[1])),
        ),
        "builtins.__import__": (lambda: builtins.__import__, lambda v: setattr(builtins, "__import__", v)),
        "builtins.print": (lambda: builtins.print, lambda v: setattr(builtins, "print", v)),
        "the display formatter": (lambda: shell.display_formatter, lambda v: setattr(shell, "display_formatter", v)),
        "text/plain printers": (
            lambda: tuple(
                dict(getattr(plain, a)) for a in ("type_printers", "deferred_printers", "singleton_printers")
            ),
            lambda v: [
                getattr(plain, a).clear() or getattr(plain, a).update(d)
                for a, d in zip(("type_printers", "deferred_printers", "singleton_printers"), v)
            ],
        ),
    }
    pristine = {name: get() for name, (get, _) in hooks.items()}
    shell_attrs = set(vars(shell))
    shell_classes = [(cls, dict(vars(cls))) for cls in type(shell).__mro__ if cls is not object]

    def reset_hooks():
        changed = []
        for name, (get, put) in hooks.items():
            if get() != pristine[name]:
                changed.append(name)
                put(pristine[name])
        for attr in set(vars(shell)) - shell_attrs:  # e.g. shell.run_cell = ... on the instance
            if callable(getattr(shell, attr, None)):
                changed.append("shell." + attr)
                delattr(shell, attr)
        for cls, genuine in shell_classes:
            for attr in set(vars(cls)) | set(genuine):
                now, before = vars(cls).get(attr), genuine.get(attr)
                if now is not before and (callable(now) or callable(before)) and not attr.startswith("__"):
                    changed.append(cls.__name__ + "." + attr)
                    if attr in genuine:
                        setattr(cls, attr, genuine[attr])
                    else:
                        delattr(cls, attr)
        return changed

    def restore(names):
        problems, notes = [], []
        notes += ["IPython hook: " + h for h in reset_hooks()]
        for modname, module in modules.items():
            if sys.modules.get(modname) is not module:
                notes.append("sys.modules[%r]" % modname)
                sys.modules[modname] = module
            parent, _, child = modname.rpartition(".")
            if parent in modules and getattr(modules[parent], child, module) is not module:
                notes.append(modname)
                setattr(modules[parent], child, module)
        for (modname, name), (cls, methods) in classes.items():
            now = vars(cls)
            for attr in set(methods) | {a for a, v in now.items() if is_method(v)}:
                genuine, code = methods.get(attr, (None, None))
                if now.get(attr) is not genuine or (code is not None and genuine.__code__ is not code):
                    problems.append("%s.%s.%s" % (modname, name, attr))
                    if genuine is None:
                        delattr(cls, attr)
                    else:
                        setattr(cls, attr, genuine)
                        if code is not None:
                            genuine.__code__ = code
        for (modname, name), obj in submodules.items():
            if getattr(modules[modname], name, obj) is not obj:
                notes.append(modname + "." + name)
                setattr(modules[modname], name, obj)
        if ledger is not None:
            trace_module, observers, observe = ledger
            if getattr(trace_module, "_RUN_OBSERVERS", None) is not observers:
                notes.append("disttrain_lab.trace._RUN_OBSERVERS (the grader's count of traced bytes)")
                trace_module._RUN_OBSERVERS = observers
            if not any(o is observe for o in observers):
                notes.append("the grader's count of traced bytes (removed from _RUN_OBSERVERS)")
                observers.append(observe)
        ns = shell.user_ns
        for name in names:
            modname = aliases.get(name)
            if modname in modules and ns.get(name, modules[modname]) is not modules[modname]:
                notes.append("the name %r (%s)" % (name, modname))
                ns[name] = modules[modname]
        for name, fp in instructor.items():
            if ns.get(name) is not fp[0]:
                notes.append("the name %r (defined by the lab)" % name)
                ns[name] = fp[0]
            if changed_code(fp[0], fp):
                problems.append("the code of %s (defined by the lab)" % name)
                restore_code(fp[0], fp)
        for (modname, name), fp in functions.items():
            module = modules.get(modname) or sys.modules.get(modname)
            current = unwrap(getattr(module, name, None)) if module is not None else None
            if current is not fp[0]:
                problems.append(modname + "." + name)
                setattr(module, name, fp[0])
            elif changed_code(current, fp):
                problems.append("the code of " + modname + "." + name)
                restore_code(current, fp)
        return problems, notes

    def record(names):
        for name in names:
            if name in shell.user_ns:
                instructor[name] = fingerprint(shell.user_ns[name])

    import hashlib
    import hmac

    key = bytes.fromhex("__DISTTRAIN_GUARD_KEY__")  # a fresh key per kernel, put in by the grader

    def signed(result, nonce):
        return result + (hmac.new(key, (nonce + repr(result)).encode(), hashlib.sha256).hexdigest(),)

    guard.before_test = lambda names, nonce: signed(restore(names) + (traffic[0],), nonce)
    guard.after_test = lambda names, nonce: signed((lambda p, n: (p + n, [], traffic[0]))(*restore(names)), nonce)
    guard.record = record
    sys.modules[guard.__name__] = guard


if __name__ == "__main__":  # in the kernel (sent as text); never when imported
    _disttrain_install_guard()
    del _disttrain_install_guard
