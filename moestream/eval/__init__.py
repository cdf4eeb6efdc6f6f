"""Offline evaluation of policies against recorded traces (prediction accuracy, GOODPRED)."""
