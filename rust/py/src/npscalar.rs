//! Reading numpy integer scalars (what `list(array)` holds) without a Python call.
//!
//! Converting a numpy scalar through `__index__` makes and frees a Python `int` per element,
//! which is most of the cost of a list of numpy scalars. A numpy scalar of an integer type is
//! a Python object whose value follows its header (numpy's `PyArrayScalar_VAL`), so once the
//! object's type is known to be *exactly* one of numpy's integer scalar types the value can
//! be read in place. The types are looked up once per interpreter; a list is read with one
//! pointer comparison per element. Anything else (Python ints, bools, subclasses, other
//! types) is left to the checked path, so the values accepted and the errors raised do not
//! change.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyInt, PyType};

/// The C integer type behind one numpy scalar type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Width {
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
}

impl Width {
    /// The width of a numpy dtype given its `kind` (`'i'` or `'u'`) and `itemsize`.
    fn of(kind: char, itemsize: usize) -> Option<Self> {
        Some(match (kind, itemsize) {
            ('i', 1) => Self::I8,
            ('i', 2) => Self::I16,
            ('i', 4) => Self::I32,
            ('i', 8) => Self::I64,
            ('u', 1) => Self::U8,
            ('u', 2) => Self::U16,
            ('u', 4) => Self::U32,
            ('u', 8) => Self::U64,
            _ => return None,
        })
    }
}

/// numpy's integer scalar types (`np.byte` ... `np.ulonglong`; the sized names such as
/// `np.int64` are aliases of these), each with its C width. Empty if numpy cannot be read.
static TYPES: PyOnceLock<Vec<(Py<PyType>, Width)>> = PyOnceLock::new();

/// The C integer scalar types of numpy, by their C names (every sized alias is one of them).
const NAMES: [&str; 10] = [
    "byte",
    "ubyte",
    "short",
    "ushort",
    "intc",
    "uintc",
    "int_",
    "uint",
    "longlong",
    "ulonglong",
];

fn load(py: Python<'_>) -> PyResult<Vec<(Py<PyType>, Width)>> {
    let np = py.import("numpy")?;
    let dtype = np.getattr("dtype")?;
    let mut types = Vec::with_capacity(NAMES.len());
    for name in NAMES {
        let Ok(ty) = np.getattr(name).and_then(|t| Ok(t.cast_into::<PyType>()?)) else {
            continue;
        };
        let descr = dtype.call1((&ty,))?;
        let kind: char = descr.getattr("kind")?.extract()?;
        let itemsize: usize = descr.getattr("itemsize")?.extract()?;
        if let Some(width) = Width::of(kind, itemsize) {
            types.push((ty.unbind(), width));
        }
    }
    Ok(types)
}

/// Reads the numpy integer scalars of one sequence: remembers the last numpy type seen, so a
/// list of one type costs one pointer comparison per element.
pub struct Scalars<'py> {
    py: Python<'py>,
    last: Option<(*mut pyo3::ffi::PyTypeObject, Width)>,
}

impl<'py> Scalars<'py> {
    /// A reader for one sequence.
    pub fn new(py: Python<'py>) -> Self {
        Self { py, last: None }
    }

    /// The exact value of `obj` if its type is exactly a numpy integer scalar type; None for
    /// anything else (a Python int included).
    #[inline]
    pub fn value(&mut self, obj: &Bound<'py, PyAny>) -> Option<i128> {
        let ty = obj.get_type_ptr();
        let width = match self.last {
            Some((last, width)) if last == ty => width,
            _ => {
                if obj.is_exact_instance_of::<PyInt>() {
                    return None;
                }
                let types = TYPES.get_or_init(self.py, || load(self.py).unwrap_or_default());
                let &(_, width) = types.iter().find(|(t, _)| t.as_ptr().cast() == ty)?;
                self.last = Some((ty, width));
                width
            }
        };
        Some(read(obj, ty, width))
    }
}

/// numpy's layout of an integer scalar object: the object header, then the C value.
#[repr(C)]
struct Scalar<T> {
    _head: pyo3::ffi::PyObject,
    value: T,
}

/// The value of `obj`, whose type `ty` was found in [`TYPES`] with `width`.
#[inline]
#[allow(unsafe_code, reason = "reads numpy's scalar value in place (PyArrayScalar_VAL)")]
fn read(obj: &Bound<'_, PyAny>, ty: *mut pyo3::ffi::PyTypeObject, width: Width) -> i128 {
    debug_assert_eq!(obj.get_type_ptr(), ty);
    let ptr = obj.as_ptr();
    // SAFETY: `obj` is alive while borrowed, and its type is exactly the numpy scalar type
    // `ty` (compared by pointer, never a subclass), whose instances numpy lays out as
    // `{PyObject_HEAD; <C integer of `width`> obval;}` (numpy's `Py<Type>ScalarObject`), i.e.
    // `Scalar<T>` with `#[repr(C)]`. Python allocates objects aligned for their struct, so
    // the field read is in bounds and aligned.
    unsafe {
        match width {
            Width::I8 => i128::from((*ptr.cast::<Scalar<i8>>()).value),
            Width::I16 => i128::from((*ptr.cast::<Scalar<i16>>()).value),
            Width::I32 => i128::from((*ptr.cast::<Scalar<i32>>()).value),
            Width::I64 => i128::from((*ptr.cast::<Scalar<i64>>()).value),
            Width::U8 => i128::from((*ptr.cast::<Scalar<u8>>()).value),
            Width::U16 => i128::from((*ptr.cast::<Scalar<u16>>()).value),
            Width::U32 => i128::from((*ptr.cast::<Scalar<u32>>()).value),
            Width::U64 => i128::from((*ptr.cast::<Scalar<u64>>()).value),
        }
    }
}
