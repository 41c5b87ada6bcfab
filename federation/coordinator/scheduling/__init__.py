"""The scheduling cycle, in parts: its settings and stage names, the rounds of offers, the
verdicts that say why a task waits. ``federation.coordinator.scheduler`` runs the loop."""
