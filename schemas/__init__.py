"""The one vocabulary: subject names, input facts, outputs, and their codec."""
