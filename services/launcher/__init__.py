"""`alise serve`: starts every service of the stack on one machine."""
