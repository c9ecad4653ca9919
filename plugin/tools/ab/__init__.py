"""``kvguard ab`` (``kvguard-ab``): the A/B job, the same workload with the plugin off and
on. ``cli`` is the command line; ``scenarios``, ``run`` (process pairs), ``serve`` (``vllm
serve`` pairs), ``micro``, ``stats``, ``report``, ``chart``; ``workload`` runs one load on a
real engine in a child that ``harness`` starts."""
