"""The statements, by concern: each module holds its named templates (``TEMPLATES``) with their comments;
:func:`..statements.statements` binds each, once per schema as it is first read, in the typed ``Statements``."""
