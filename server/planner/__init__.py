"""Pure planning: performance models, batch plans and placement. No database, no HTTP, no clock."""
