"""Health that tells the truth: EngineCore's heartbeat (``heartbeat``, in every
EngineCore) and the front end's verdict on it (``verdict``: vLLM's ``/health`` answers
503 when EngineCore holds work and completes no step, or its queue is wedged)."""
