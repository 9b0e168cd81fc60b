//! The runner and consumer against a real Azurite (filled in below).
