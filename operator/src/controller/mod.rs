//! The controller: caches, decision passes and applying their plans.
