"""Checkpoints, login side and both wings (standard library only): the directory and its manifests
(``directory``), the format a job saves in (``format``), the lock (``dirlock``), the model fields that shape the
tensors (``weights``) and the rules a resume at another layout follows (``resume_rules``)."""
