"""The sending side: a message written as a row, where a send goes, unique keys."""
