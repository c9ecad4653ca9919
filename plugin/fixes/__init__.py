"""The fixes: they decide what to do; the patches in ``vllm_kvguard.patches`` install them.

Each fix is a pluggy hookimpl object built by its patch's setup with the configuration it
needs (from the ``Flags`` activation read) and the declared changes it may make.
"""
