"""Speculative decoding: one proposer per method (``proposer.Proposer``: the tokens a
grammar forces, prompt lookup's, a draft model's), and the ``Drafter`` that asks them in
order, keeps each run's state per proposer and counts what they drafted and the model
confirmed. Adding a method is a module here and a line in ``methods``."""
