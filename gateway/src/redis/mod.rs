//! Everything that speaks to Redis: the connections ([`store`]), the
//! addresses and credentials ([`url`]), Sentinel ([`sentinel`]), the key
//! layout ([`keys`]), and the Lua scripts with their arguments and replies
//! ([`script`], the `.lua` files beside it).

pub mod keys;
pub mod script;
pub mod sentinel;
pub mod store;
pub mod url;
