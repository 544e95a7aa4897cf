"""Planted wrong answers: each chapter module lists ``PLANTED``, ``(number, hint key it must trigger, answer)``."""
