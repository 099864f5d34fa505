"""The engine's core: what a step decides, as plain data from plain state. Jobs in and
outputs out (``jobs``), a slot and the run on it (``slots``), the scheduler's admissions
and its plan of one ``llama_decode`` (``scheduler``, ``plan``), what steps cost as
measured (``stepcost``), thinking budgets (``thinking``), a run's grammar matcher
(``matcher``). No llama.cpp here, and nothing from the engine's other parts: a test
imports it with llama_cpp unavailable."""
